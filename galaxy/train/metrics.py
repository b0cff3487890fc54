"""What a run reports about its speed and where it writes it: tokens/s, tokens/s per device, MFU,
and the TensorBoard event files of ``--tensorboard``.

* tokens/s: the tokens of the step's global batch (padding included) over the step's wall time;
  per device: that over the world size (every rank of dp x pp x mp), as torchtitan's logs report.
* MFU, model FLOPs utilisation, as torchtitan and PaLM define it: the model FLOPs a device achieves
  per second over its peak,

      mfu = model_flops_of_the_step / step_time_s / world_size / peak_flops_per_device

  with the model FLOPs of ``galaxy.profiler.model_flops`` (full training: ``6 * N + 12 * L * H * S``
  per token, N the matmul weights, L layers, H hidden size, S the batch's sequence length) and the
  peak from ``peak_tflops`` (``--peak_tflops`` or the config key), else from
  ``galaxy.profiler.devices.PEAK_TFLOPS`` for rank 0's GPU and the run's dtype (bfloat16 / float16:
  the tensor-core peak; float32: TF32's where torch lets matmuls use TF32, else plain FP32). A CPU,
  an unknown accelerator or float64 has no peak to divide by: MFU is then None, never a guess.
* ``mfu_causal``: the same with the attention core counted as a causal kernel computes it, half the
  S x S scores (full training ``6 * N + 6 * L * H * S``; Megatron's and FlashAttention's count of a
  causal LM), beside ``mfu`` (torchtitan's full-matrix count) wherever MFU is stated: a causal LM's
  ``mfu`` overstates the attention work it ran, by 12% of the step's FLOPs for LLaMA-7B at seq 4096.
* The steady state (``SteadyState``): a run's summary is over its steps after ``WARMUP_STEPS`` (the
  first steps compile, fill the allocator's cache and create the optimizer's state) and without a
  profiled step: the median step time, and tokens/s and MFU of the mean step over it, which is
  ``bench/bench_train.py``'s definition (tokens per step over the median of the steps after its
  ``--warmup``), so a CLI run and the benchmark state the same figure for the same configuration.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Optional

import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.profiler.devices import lookup_peak_tflops
from galaxy.models import family
from galaxy.profiler.model_flops import MatmulWeights, training_flops_per_token

logger = logging.getLogger(__name__)

TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard"

# The run's dtype -> the key of galaxy.profiler.devices.PEAK_TFLOPS (float32 is decided at run time: TF32 or not).
PEAK_KEYS = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class PeakFlops:
    """The peak FLOP/s of one device that MFU divides by, and where it came from (or why there is none)."""

    flops_per_s: Optional[float]
    source: str

    @property
    def tflops(self) -> Optional[float]:
        return None if self.flops_per_s is None else self.flops_per_s / 1e12


def peak_flops_per_device(device: torch.device, dtype: str, peak_tflops: Optional[float] = None) -> PeakFlops:
    """``peak_tflops`` (dense TFLOP/s) when given, else the table's peak for ``device`` (a CUDA GPU
    named in ``PEAK_TFLOPS``) and the run's ``dtype`` name (``train.dtype``), else none."""
    if peak_tflops is not None:
        return PeakFlops(peak_tflops * 1e12, "peak_tflops")
    if device.type != "cuda":
        return PeakFlops(None, f"no peak FLOP/s is known for a {device.type} device; pass --peak_tflops")
    name = torch.cuda.get_device_name(device)
    if dtype == "float32":
        key = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    else:
        key = PEAK_KEYS.get(dtype)
    peak = lookup_peak_tflops(name, key) if key else None
    if peak is None:
        return PeakFlops(None, f"no peak FLOP/s is known for {name} in {dtype}; pass --peak_tflops")
    return PeakFlops(peak * 1e12, f"{name}, {key} dense")


def model_matmul_weights(cfg: GalaxyConfig) -> MatmulWeights:
    """N of ``6 N``: the matmul weights a token of this run's model and task goes through."""
    m = cfg.model
    return MatmulWeights(*family(m.model_type).matmul_weights(m, cfg.train.task), m.num_hidden_layers)


def model_flops_per_token(cfg: GalaxyConfig, seq_length: int) -> float:
    """Model FLOPs per token of this run's training step (its tuning method) on sequences of ``seq_length``."""
    return training_flops_per_token(model_matmul_weights(cfg), cfg.model.hidden_size, seq_length, cfg.peft.tuning)


def causal_flops_per_token(cfg: GalaxyConfig, seq_length: int) -> float:
    """``model_flops_per_token`` with the attention core's term halved: the scores a causal kernel computes
    (full training ``6 N + 6 L H S``). The term is what the count adds over sequences of no length."""
    whole, weights_only = model_flops_per_token(cfg, seq_length), model_flops_per_token(cfg, 0)
    return weights_only + (whole - weights_only) / 2


def throughput(tokens: float, model_flops: float, seconds: float, world_size: int, peak: PeakFlops,
               causal_flops: Optional[float] = None) -> dict:
    """``tokens_per_s``, ``tokens_per_s_per_gpu`` and ``mfu`` (None without a peak) of ``tokens``
    tokens and ``model_flops`` FLOPs computed by ``world_size`` devices in ``seconds``; with
    ``causal_flops`` (the same step's FLOPs with causal attention's count) also ``mfu_causal``."""
    if seconds <= 0:
        return {"tokens_per_s": 0.0, "tokens_per_s_per_gpu": 0.0, "mfu": None,
                **({"mfu_causal": None} if causal_flops is not None else {})}
    tokens_per_s = tokens / seconds
    per_device = seconds * world_size * peak.flops_per_s if peak.flops_per_s else None
    out = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / world_size,
           "mfu": model_flops / per_device if per_device else None}
    if causal_flops is not None:
        out["mfu_causal"] = causal_flops / per_device if per_device else None
    return out


# Steps a run's steady state leaves out at its start, as bench/bench_train.py's --warmup does by default.
WARMUP_STEPS = 2


@dataclass
class SteadyState:
    """A run's steps, each as it is added (``add``: its rates, for the per-step metrics), and their steady
    state (``summary``): the steps after the first ``warmup`` and not ``skip``-ped (a profiled step), or,
    in a run too short for that, its last step. Summary: ``step_time_s`` the median of their times,
    ``tokens_per_s`` / ``tokens_per_s_per_gpu`` / ``mfu`` / ``mfu_causal`` of their mean step at that
    time (tokens per step over the median step time: bench_train's figure), ``timed_steps``."""

    cfg: GalaxyConfig
    world_size: int
    peak: PeakFlops
    warmup: int = WARMUP_STEPS
    steps: list = field(default_factory=list)  # (seconds, tokens, flops, causal flops, skipped, values)

    def add(self, seconds: float, tokens: int, seq_length: int, skip: bool = False, **values: float) -> dict:
        """One step of ``tokens`` tokens in sequences of ``seq_length``, ``seconds`` long (``values``: more
        per-step numbers, averaged over the steady steps by ``mean``); returns the step's own rates."""
        flops = tokens * model_flops_per_token(self.cfg, seq_length)
        causal = tokens * causal_flops_per_token(self.cfg, seq_length)
        self.steps.append((seconds, tokens, flops, causal, skip, values))
        return throughput(tokens, flops, seconds, self.world_size, self.peak, causal)

    def steady(self) -> list:
        """The steps the summary is over (1-based indices in the run)."""
        kept = [i for i, s in enumerate(self.steps, 1) if i > self.warmup and not s[4]]
        if not kept and self.steps:  # a run of no more steps than the warm-up: its last unskipped one
            kept = [max((i for i, s in enumerate(self.steps, 1) if not s[4]), default=len(self.steps))]
        return kept

    def mean(self, key: str) -> float:
        chosen = [self.steps[i - 1][5].get(key, 0.0) for i in self.steady()]
        return sum(chosen) / len(chosen) if chosen else 0.0

    def summary(self) -> dict:
        kept = [self.steps[i - 1] for i in self.steady()]
        if not kept:
            return {"step_time_s": 0.0, "timed_steps": 0, **throughput(0, 0.0, 0.0, self.world_size, self.peak, 0.0)}
        median = statistics.median(s[0] for s in kept)
        n = len(kept)
        rates = throughput(sum(s[1] for s in kept) / n, sum(s[2] for s in kept) / n, median, self.world_size,
                           self.peak, sum(s[3] for s in kept) / n)
        return {"step_time_s": median, "timed_steps": n, **rates}


def check_tensorboard_installed() -> None:
    """Raise the one-line ``ConfigError`` of a missing tensorboard package (before any rank starts)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(TENSORBOARD_MISSING) from None


class TensorBoardWriter:
    """Rank 0's TensorBoard event files: one scalar per metric and step, from the metrics record."""

    # metrics record key -> TensorBoard tag; eval_* keys go under eval/.
    TAGS = {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "loss_scale": "train/loss_scale",
        "tokens_per_s": "throughput/tokens_per_s",
        "tokens_per_s_per_gpu": "throughput/tokens_per_s_per_gpu",
        "mfu": "throughput/mfu",
        "mfu_causal": "throughput/mfu_causal",
        "step_time_s": "throughput/step_time_s",
        "peak_mem_mb": "memory/peak_mem_mb",
        "comm_bytes": "comm/bytes",
    }

    def __init__(self, log_dir: str):
        check_tensorboard_installed()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)
        logger.info("TensorBoard event files in %s", log_dir)

    @classmethod
    def tag(cls, key: str) -> Optional[str]:
        if key.startswith("eval_"):
            return "eval/" + key[len("eval_"):]
        return cls.TAGS.get(key)

    def write(self, record: dict) -> None:
        """Every numeric value of a metrics record (``step`` is the x axis; None is skipped)."""
        step = record["step"]
        for key, value in record.items():
            tag = self.tag(key)
            if tag is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
