"""What fp8 costs in quality, measured on the CPU (the numbers fp8 rounds to are the same on any device):

(a) full training: a small LLaMA pretrained from scratch on real text (the Python standard library's own
    sources, one document a file, the last tenth held out) for ``--steps`` steps through
    ``pretrain_galaxy.py`` three times from the same seed, data order and init: bf16 autocast, and the same
    with ``float8_training`` tensorwise and rowwise (torchao's float8 matmuls in every layer linear). Each
    run's per-step training loss and its held-out loss every ``eval_every`` steps, from ``--metrics_file``.
(b) a frozen base: LoRA over a bf16 base against LoRA over the fp8 base (``quantize_base: fp8``) through
    ``compare_tuning.py`` (LLaMA instruction tuning from one base pretrained there and cached), their
    held-out loss after tuning.

The runs go side by side, each in its own one-thread process (the WordPiece trained once first, so every
pretraining run reads the same vocabulary).

    nice -n 19 python bench/fp8_quality.py --out docs/results/fp8_quality_2026-12-01_<commit>_cpu.json

On a GPU the same comparison runs at other shapes, one run after another (``--sequential``: one device), with
``--override`` keys over the small model's (issue 51's LLaMA-7B line, ``bench/device/round7.sh`` part f8curve:
its 4 layers at 4,096 tokens a row, compiled, the sources of the standard library and the installed packages as
text, so that 1,000 steps do not repeat it):

    python3 bench/fp8_quality.py --parts pretrain --sequential --variants bf16,fp8-tensorwise --recursive \
        --sources $(python3 -c 'import sysconfig; p = sysconfig.get_paths(); print(p["stdlib"], p["purelib"])') \
        --override preset=llama-7b --override num_hidden_layers=4 --override seq_length=4096 ... --out F.json

The verdicts (fp8 / bf16) are in the JSON's ``summary``: the final training loss (mean of the last
``--tail`` steps) and the final held-out loss of each fp8 recipe against bf16's, and the tuned held-out
loss of LoRA on the fp8 base against LoRA on the bf16 base.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# llama-tiny's shape (every linear's dims multiples of 16, so all of them run in float8), a WordPiece of 1024
# trained on the text; 1,024 tokens a step. About 0.05 s of CPU a step in bf16 and 0.1 s in fp8 (torchao's
# float8 on the CPU runs torch._scaled_mm's emulation).
PRETRAIN = dict(preset="llama-tiny", vocab_size=1024, seq_length=128, global_batch_size=8, dtype="bfloat16",
                lr=1e-3, warmup_steps=50, lr_schedule="cosine", weight_decay=0.01, eval_iters=4, plan="none",
                seed=1234)
VARIANTS = {"bf16": {}, "fp8-tensorwise": {"float8_training": "tensorwise"},
            "fp8-rowwise": {"float8_training": "rowwise"}}
LORA_METHODS = ("lora-bf16", "lora-fp8", "lora-fp8head")


def write_corpus(path: str, sources: list[str], recursive: bool = False) -> int:
    """One JSON line per source file of the ``sources`` folders (``recursive``: in every folder below them but
    installed packages' folders, which a source of their own names); returns how many."""
    files = []
    for folder in sources:
        pattern = os.path.join(folder, "**", "*.py") if recursive else os.path.join(folder, "*.py")
        files += sorted(f for f in glob.glob(pattern, recursive=recursive)
                        if not {"site-packages", "dist-packages"} & set(os.path.relpath(f, folder).split(os.sep)))
    if not files:
        raise SystemExit(f"no *.py under {', '.join(sources)}; pass --sources")
    with open(path, "w", encoding="utf-8") as f:
        for name in files:
            with open(name, encoding="utf-8", errors="replace") as src:
                f.write(json.dumps({"text": src.read()}) + "\n")
    return len(files)


class Run:
    """``cmd`` started from the repository root in a process of its own (``one_thread``: the runs go side by side
    on shared cores), its output to ``log``."""

    def __init__(self, cmd: list[str], log: str, one_thread: bool = True):
        self.cmd, self.log, self.start, self.seconds = cmd, log, time.time(), None
        path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)  # the caller's packages too
        env = dict(os.environ, PYTHONPATH=path, **({"OMP_NUM_THREADS": "1"} if one_thread else {}))
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait(self) -> float:
        """Its wall seconds, once it ended well (asked again: the same)."""
        if self.proc.wait() != 0:
            raise SystemExit(f"{' '.join(self.cmd)} failed ({self.proc.returncode}); see {self.log}")
        if self.seconds is None:
            self.seconds = time.time() - self.start
        return self.seconds


def shared_tokenizer(corpus: str, vocab_size: int) -> None:
    """The WordPiece every run reads, trained here once into Galaxy's tokenizer cache (runs side by side would
    each train one, and equally good vocabularies can differ: ``galaxy.data.tokenizer.train_wordpiece``)."""
    from galaxy.data.corpus import read_documents
    from galaxy.data.tokenizer import shared_wordpiece

    shared_wordpiece(read_documents(corpus), vocab_size, lambda make: make())


def start_pretrain(name: str, overrides: dict, corpus: str, args) -> tuple[Run, dict, str]:
    metrics = os.path.join(args.work_dir, f"{name}.metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    keys = dict(PRETRAIN, eval_every=args.eval_every, **args.overrides, **overrides)
    flags = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in keys.items()]  # true, not True
    cmd = [sys.executable, "pretrain_galaxy.py", "--world", "1", "--max_steps", str(args.steps), "--data", corpus,
           "--metrics_file", metrics, "--no_progress", *sum((["--override", f] for f in flags), [])]
    return Run(cmd, os.path.join(args.work_dir, f"{name}.log"), one_thread=not args.sequential), keys, metrics


def pretrain_result(run: Run, keys: dict, metrics: str, args) -> dict:
    seconds = run.wait()
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    losses = [r["loss"] for r in records]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    return {"config": keys, "wall_s": seconds, "losses": losses, "eval_loss": evals,
            "final_train_loss": sum(losses[-args.tail:]) / len(losses[-args.tail:]), "final_eval_loss": evals[-1][1],
            "step_time_s_median": sorted(r["step_time_s"] for r in records)[len(records) // 2]}


def start_lora(args) -> Run:
    out = os.path.join(args.work_dir, "lora")
    cmd = [sys.executable, "compare_tuning.py", "--model", "llama", "--methods", ",".join(LORA_METHODS),
           "--max_steps", str(args.lora_steps), "--out_dir", out, "--cache_dir", os.path.join(args.work_dir, "bases"),
           "--in_process"]
    return Run(cmd, os.path.join(args.work_dir, "lora.log"))


def lora_result(run: Run, args) -> dict:
    seconds = run.wait()
    with open(os.path.join(args.work_dir, "lora", "compare_tuning.json")) as f:
        table = json.load(f)
    rows = {r["method"]: {k: r[k] for k in ("eval_loss_before", "eval_loss_after", "metric_before", "metric_after",
                                            "trainable_params", "losses")} for r in table["results"]}
    return {"wall_s": seconds, "title": table["title"], "base": table["base"], "results": rows}


def summarize(runs: dict, tuned: dict) -> dict:
    base = runs.get("bf16")
    summary = {}
    for name, r in runs.items():
        if name == "bf16":
            continue
        summary[name] = {"final_train_loss": r["final_train_loss"], "bf16_final_train_loss": base["final_train_loss"],
                         "train_loss_ratio": r["final_train_loss"] / base["final_train_loss"],
                         "final_eval_loss": r["final_eval_loss"], "bf16_final_eval_loss": base["final_eval_loss"],
                         "eval_loss_ratio": r["final_eval_loss"] / base["final_eval_loss"]}
    if tuned:
        theirs = tuned["results"]["lora-bf16"]["eval_loss_after"]
        for method in LORA_METHODS[1:]:
            ours = tuned["results"][method]["eval_loss_after"]
            summary[method] = {"eval_loss_after": ours, "bf16_eval_loss_after": theirs,
                               "eval_loss_ratio": ours / theirs}
    return summary


def parse_override(text: str) -> tuple[str, object]:
    """``key=value`` with the value read as JSON where it parses (numbers, booleans), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--override '{text}': expected key=value, e.g. num_hidden_layers=4")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the results JSON")
    p.add_argument("--work_dir", default="/tmp/fp8_quality", help="corpus, metrics, logs, the cached LoRA base")
    p.add_argument("--sources", nargs="+", default=["/usr/lib/python3.11"],
                   help="directories of *.py files: the text (the held-out tenth: the last documents)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--tail", type=int, default=50, help="steps averaged for the final training loss")
    p.add_argument("--lora_steps", type=int, default=200)
    p.add_argument("--parts", default="pretrain,lora", help="pretrain, lora or both")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"pretraining runs, of {', '.join(VARIANTS)}")
    p.add_argument("--override", type=parse_override, action="append", default=[], metavar="KEY=VALUE",
                   help="a config key over the small model's, for every pretraining run (repeat the flag)")
    p.add_argument("--sequential", action="store_true",
                   help="one run after another, each with every core (one GPU holds one run)")
    p.add_argument("--recursive", action="store_true", help="text from every folder below --sources")
    args = p.parse_args(argv)
    args.overrides = dict(args.override)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if "bf16" not in variants:
        p.error("--variants needs bf16: every verdict is against it")
    os.makedirs(args.work_dir, exist_ok=True)
    parts = set(args.parts.split(","))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    import torch

    try:
        import torchao
        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    report = {"date": datetime.date.today().isoformat(), "commit": commit, "device": device_name(),
              "torch": torch.__version__, "torchao": torchao_version, "cpus": os.cpu_count(),
              "load_average_at_start": os.getloadavg()}
    started = {}
    if "pretrain" in parts:
        corpus = os.path.join(args.work_dir, "stdlib.jsonl")
        report["corpus"] = {"sources": args.sources, "documents": write_corpus(corpus, args.sources, args.recursive),
                            "bytes": os.path.getsize(corpus), "held_out": "the last tenth of the documents"}
        shared_tokenizer(corpus, args.overrides.get("vocab_size", PRETRAIN["vocab_size"]))
        for name in variants:
            print(f"-- {name}: {args.steps} steps", flush=True)
            started[name] = start_pretrain(name, VARIANTS[name], corpus, args)
            if args.sequential:
                started[name][0].wait()
    lora_run = None
    if "lora" in parts:
        print(f"-- {', '.join(LORA_METHODS)}: {args.lora_steps} steps", flush=True)
        lora_run = start_lora(args)
    runs = {}
    for name, (run, keys, metrics) in started.items():
        runs[name] = pretrain_result(run, keys, metrics, args)
        print(f"   {name}: final training loss {runs[name]['final_train_loss']:.4f}, held-out "
              f"{runs[name]['final_eval_loss']:.4f} ({runs[name]['wall_s']:.0f} s)", flush=True)
    tuned = lora_result(lora_run, args) if lora_run is not None else {}
    report.update(pretraining=runs, lora=tuned, summary=summarize(runs, tuned))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
