# Sourced by the bench/device launch scripts (train_node.sh, lora_unsloth.sh, planner_node.sh): a launch that
# outlives one `run` call (setsid + nohup), started by `start`, waited for by `wait` in later calls. Its files,
# under DIR: TAG.pid, TAG.console (its output), TAG.done (when it ended), clocks_TAG.csv (every GPU's SM clock,
# power and temperature every 200 ms while it ran: a sustained step may run below the clocks of short bursts).

# Exit if DIR's launch TAG is still running.
refuse_if_running() {
    local dir=$1 tag=$2
    if [ -e "$dir/$tag.pid" ] && kill -0 "$(cat "$dir/$tag.pid")" 2>/dev/null; then
        echo "already running: $tag (pid $(cat "$dir/$tag.pid")); call wait"; exit 1
    fi
}

# Copy the working tree to DIR/src and cd there: a later `run` call sends the working tree again, and a process
# whose directory went with the old copy fails (os.getcwd() in torch._dynamo's config).
enter_own_tree() {
    local dir=$1
    rm -rf "$dir/src" && mkdir -p "$dir/src" && cp -r . "$dir/src/" && cd "$dir/src" || exit 1
}

# Run the shell command CMD detached, logging the GPUs' clocks beside it; prints its pid.
start_detached() {
    local dir=$1 tag=$2 cmd=$3
    rm -f "$dir/$tag.done" "$dir/clocks_$tag.csv"
    local clocks="nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 200"
    cmd=$(sed 's/[; ]*$//' <<< "$cmd")  # a trailing ';' would end the line below in ';;'
    setsid nohup bash -c "$clocks > $dir/clocks_$tag.csv 2>&1 & watcher=\$!; $cmd; kill \$watcher; \
touch $dir/$tag.done" > "$dir/$tag.console" 2>&1 < /dev/null &
    echo $! > "$dir/$tag.pid"
    echo "started $tag (pid $!)"
}

# Wait up to POLLS x 10 s for DIR's launch TAG to end.
wait_done() {
    local dir=$1 tag=$2 polls=$3
    for _ in $(seq 1 "$polls"); do
        [ -e "$dir/$tag.done" ] && break
        if ! kill -0 "$(cat "$dir/$tag.pid" 2>/dev/null)" 2>/dev/null; then
            echo "the launch ended without finishing (no $tag.done): see $tag.console"; touch "$dir/$tag.done"; break
        fi
        sleep 10
    done
}
