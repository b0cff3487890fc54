"""The measurements of ``tests/loralib/test_stored_base.py``, each in a fresh process:

    python -m tests.loralib.build_memory_child '[{"layers": 4, "dtype": "bfloat16"}, ...]'

imports torch and Galaxy once, then forks one child per spec (so no import time is paid twice and
every child starts from the same resident pages). A child builds a LLaMA base the way a run does
(``build_base`` + ``apply_tuning``), takes one training step, and prints one JSON line: its peak RSS
(``ru_maxrss``: a forked child's own high-water mark, starting at what it inherited) and the frozen
parameters it holds. With ``"save": DIR`` a child instead builds the fp32 model and writes it with
``save_pretrained`` (the checkpoint a later child reads from ``model_path``). With ``"world": N`` (and
``"plan"``, default tp) the spec forks N children, the ranks of one Gloo group, that build the model on that
plan (``build_base``: each rank its shard) and take one step of Galaxy's Trainer; each prints its own line
(``rank``, and ``frozen_bytes``: its shard's)."""

from __future__ import annotations

import json
import os
import resource
import sys

# Sizes differ only in the number of layers; a small vocabulary so the layers dominate. Each MLP weight is
# 33.5 MB in fp32, above glibc's largest mmap threshold (32 MB): the build's transient fp32 tensor goes
# back to the system when freed, instead of leaving heap holes whose layout varies by process.
MODEL = dict(preset="llama-tiny", hidden_size=512, intermediate_size=16384, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=1024, max_position_embeddings=64, seq_length=32, global_batch_size=1)


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def main(spec: dict, rank: int = 0, port: int = 0) -> dict:
    import torch

    from galaxy.config import DistributedConfig, GalaxyConfig
    from galaxy.core.context import ParallelContext
    from galaxy.models.llama import LlamaForCausalLM
    from galaxy.peft import apply_tuning, build_base, frozen_bytes

    torch.set_num_threads(1)
    raw = dict(MODEL, num_hidden_layers=spec["layers"], tuning="lora", dtype=spec.get("dtype", "float32"),
               quantize_base=spec.get("quantize_base", "none"))
    world = spec.get("world", 1)
    if world > 1:
        return on_a_plan(spec, GalaxyConfig.from_dict(dict(raw, plan=spec.get("plan", "tp"))), ParallelContext.initialize(
            DistributedConfig(init_method=f"tcp://127.0.0.1:{port}", timeout_s=120), rank, world, "cpu"))
    if spec.get("save"):
        model = LlamaForCausalLM(GalaxyConfig.from_dict(raw).model, seed=1)
        model.save_pretrained(spec["save"])
        return {"saved": spec["save"]}
    if spec.get("model_path"):
        raw["model_path"] = spec["model_path"]
    cfg = GalaxyConfig.from_dict(raw)
    model = apply_tuning(build_base(cfg, None, ParallelContext.serial()), cfg)
    built = peak_kib()
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith("Rss")}
    nbytes, frozen = frozen_bytes(model)
    if spec.get("step", True):
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_length), generator=gen)
        amp = cfg.train.dtype in ("bfloat16", "float16")
        with torch.autocast("cpu", dtype=getattr(torch, cfg.train.dtype), enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
    return {"peak_kib": peak_kib(), "built_kib": built, "frozen": frozen, "frozen_bytes": nbytes,
            "dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}), "rss_at_built": status}


def on_a_plan(spec: dict, cfg, ctx) -> dict:
    """This rank's model on the plan, built as a run builds it, and one step of Galaxy's Trainer."""
    import torch

    from galaxy.peft import apply_tuning, build_base, frozen_bytes
    from galaxy.train.loop import autocast_context, make_trainer

    try:
        model = apply_tuning(build_base(cfg, cfg.resolve_plan(ctx.mp.size), ctx), cfg)
        built = peak_kib()
        nbytes, frozen = frozen_bytes(model)
        trainer = make_trainer(model, cfg, ctx)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_length), generator=gen)
        loss = trainer.forward_backward({"input_ids": ids, "labels": ids}, lambda: autocast_context(cfg, ctx.device))
        trainer.optimizer_step(loss, 1)
        return {"rank": ctx.rank, "peak_kib": peak_kib(), "built_kib": built, "frozen": frozen, "frozen_bytes": nbytes,
                "dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})}
    finally:
        ctx.shutdown()


def run_all(specs: list) -> None:
    import torch  # noqa: F401 - imported before forking: the children share it
    import torch._dynamo  # noqa: F401 - a child's first parameter init would import it (about 1 s of CPU each)

    import galaxy.peft  # noqa: F401
    import galaxy.models.llama  # noqa: F401
    from galaxy.core.context import import_world_binders

    import_world_binders()  # what a child's ParallelContext.initialize imports, here once

    from galaxy.cli.launch import free_port

    for spec in specs:
        sys.stdout.flush()
        port = free_port()
        pids = []
        for rank in range(spec.get("world", 1)):  # the ranks of one group, side by side
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    line = json.dumps(dict(main(spec, rank, port), spec=spec))
                except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
                    line = json.dumps({"spec": spec, "error": repr(e)})
                    code = 1
                sys.stdout.write(line + "\n")  # one write: ranks print side by side (unbuffered stdout too)
                sys.stdout.flush()
                os._exit(code)
            pids.append(pid)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if status:
                print(json.dumps({"spec": spec, "error": f"child exited with status {status}"}), flush=True)


if __name__ == "__main__":
    run_all(json.loads(sys.argv[1]))
