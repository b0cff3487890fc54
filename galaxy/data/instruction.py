"""Instruction tuning data (LLaMA): Alpaca-style JSON / JSONL examples and causal-LM batches."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import torch

from galaxy.data.batching import IGNORE_INDEX, EpochPermutation, check_int, seeded_generator, shard_bounds
from galaxy.errors import DataError

logger = logging.getLogger(__name__)


ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_prompt(instruction: str, input: str = "") -> str:  # noqa: A002 (Alpaca's field name)
    """The Alpaca prompt (everything before the response)."""
    if input:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def validate_example(obj: Any, where: str) -> dict[str, str]:
    hint = "each example needs string fields 'instruction' and 'output' (and optionally 'input')"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}; {hint}")
    for key in ("instruction", "output"):
        if key not in obj:
            raise DataError(f"{where}: missing field {key!r}; {hint}")
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
    if not obj["instruction"].strip():
        raise DataError(f"{where}: field 'instruction' is empty; {hint}")
    inp = obj.get("input")
    if inp is None:
        inp = ""
    if not isinstance(inp, str):
        raise DataError(f"{where}: field 'input' must be a string, got {type(inp).__name__}")
    return {"instruction": obj["instruction"], "input": inp, "output": obj["output"]}


def load_instruction_data(path: str | os.PathLike) -> list[dict[str, str]]:
    """Alpaca-style examples from a ``.json`` list or a ``.jsonl`` file, as dicts with keys
    ``instruction``, ``input`` ('' when absent) and ``output``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"instruction data file not found: {path!r}; pass an Alpaca-style .json "
                        f"(list of objects) or .jsonl file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".jsonl"):
        raise DataError(f"instruction data file {path!r} has unsupported extension {ext!r}; use "
                        f".json (a list of objects) or .jsonl (one object per line)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"instruction data file {path!r} is not valid UTF-8 ({e}); re-encode it") from None
    examples: list[dict[str, str]] = []
    if ext == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON at line {e.lineno} ({e.msg}); a .json file must "
                            f"hold a list of objects (use .jsonl for one object per line)") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: top-level JSON must be a list of examples, got "
                            f"{type(data).__name__}")
        examples = [validate_example(obj, f"{path}: example {i}") for i, obj in enumerate(data)]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each .jsonl line must be "
                                f"one example object") from None
            examples.append(validate_example(obj, f"{path}:{lineno}"))
    if not examples:
        raise DataError(f"instruction data file {path!r} contains no examples; add at least one")
    logger.info("loaded %d instruction examples from %s", len(examples), path)
    return examples


class InstructionBatcher:
    """Causal-LM batches for instruction tuning, a pure function of the step.

    Each example becomes ``[BOS] prompt response [EOS]`` (BOS only when the tokenizer has one),
    the prompt being :func:`format_prompt` of instruction and input. ``labels`` equal
    ``input_ids`` on response and EOS positions and are -100 elsewhere (BOS, prompt, padding);
    they are *not* shifted -- the model/loss predicts ``labels[:, t+1]`` from position ``t``, as in
    HF causal LMs. Examples longer than ``seq_len`` keep their prompt and lose the end of the
    response (the EOS too); examples whose prompt alone fills ``seq_len`` are dropped with a warning.

    Rows: one example per row, or with ``pack=True`` several whole examples per row (next-fit, in
    an order seeded by ``seed``; packed once, so a row's members are fixed across epochs). Each
    epoch visits all rows in a permutation seeded by ``(seed, epoch)``; ``batch_at(step)`` takes
    rows ``step*B .. step*B+B-1`` of that stream and right-pads them to the longest row of the
    *global* batch (so all shards have the same width). Packed rows carry no cross-example
    attention mask: the causal attention sees earlier examples in the row.
    """

    def __init__(
        self,
        examples: Sequence[dict[str, Any]],
        tokenizer: Any,
        seq_len: int,
        global_batch_size: int,
        seed: int = 0,
        pack: bool = False,
    ) -> None:
        check_int("InstructionBatcher seq_len", seq_len, 2)
        check_int("InstructionBatcher global_batch_size", global_batch_size, 1)
        check_int("InstructionBatcher seed", seed, 0)
        for attr in ("encode", "eos_id", "pad_id"):
            if not hasattr(tokenizer, attr):
                raise ValueError(f"InstructionBatcher tokenizer {type(tokenizer).__name__} has no "
                                 f"{attr!r}; use ByteTokenizer or HFTokenizer (load_tokenizer)")
        if not examples:
            raise ValueError("InstructionBatcher: examples is empty; load some with load_instruction_data")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.pack = bool(pack)

        bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
        self._tokens: list[list[int]] = []
        self._prompt_len: list[int] = []
        dropped = truncated = 0
        for i, raw in enumerate(examples):
            ex = validate_example(raw, f"InstructionBatcher example {i}")
            prompt = bos + list(tokenizer.encode(format_prompt(ex["instruction"], ex["input"])))
            response = list(tokenizer.encode(ex["output"])) + [tokenizer.eos_id]
            if len(prompt) >= seq_len:
                dropped += 1
                continue
            if len(prompt) + len(response) > seq_len:
                truncated += 1
            self._tokens.append((prompt + response)[:seq_len])
            self._prompt_len.append(len(prompt))
        if dropped:
            logger.warning("InstructionBatcher: dropped %d of %d examples whose prompt fills "
                           "seq_len=%d", dropped, len(examples), seq_len)
        if truncated:
            logger.warning("InstructionBatcher: truncated the response of %d examples to seq_len=%d",
                           truncated, seq_len)
        if not self._tokens:
            raise ValueError(f"InstructionBatcher: every prompt is at least seq_len={seq_len} tokens "
                             f"long, so no response fits; raise seq_len")
        self.num_examples = len(self._tokens)

        if self.pack:
            order = torch.randperm(self.num_examples, generator=seeded_generator(seed, "instr-pack")).tolist()
            self._rows: list[list[int]] = []
            current: list[int] = []
            used = 0
            for i in order:
                n = len(self._tokens[i])
                if current and used + n > seq_len:
                    self._rows.append(current)
                    current, used = [], 0
                current.append(i)
                used += n
            self._rows.append(current)
        else:
            self._rows = [[i] for i in range(self.num_examples)]
        self._row_len = [sum(len(self._tokens[i]) for i in row) for row in self._rows]
        self.num_rows = len(self._rows)
        self._order = EpochPermutation(self.num_rows, seed, "instr-order")
        logger.info("InstructionBatcher: %d examples -> %d rows (pack=%s, seq_len=%d)",
                    self.num_examples, self.num_rows, self.pack, seq_len)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_rows // self.global_batch_size)

    def row_examples(self, step: int, row: int) -> list[int]:
        """Indices (into the kept examples) packed in global row ``row`` of ``step``."""
        return list(self._rows[self._order(step * self.global_batch_size + row)])

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``labels`` LongTensors ``[rows, width]``, width =
        longest row of the global batch (<= seq_len)."""
        check_int("step", step, 0)
        lo, hi = shard_bounds(self.global_batch_size, shard)
        rows = [self._order(step * self.global_batch_size + r) for r in range(self.global_batch_size)]
        width = max(self._row_len[r] for r in rows)
        input_ids = torch.full((hi - lo, width), self.tokenizer.pad_id, dtype=torch.long)
        attention = torch.zeros((hi - lo, width), dtype=torch.long)
        labels = torch.full((hi - lo, width), IGNORE_INDEX, dtype=torch.long)
        for out, r in enumerate(rows[lo:hi]):
            pos = 0
            for i in self._rows[r]:
                toks, n_prompt = self._tokens[i], self._prompt_len[i]
                t = torch.tensor(toks, dtype=torch.long)
                input_ids[out, pos:pos + len(toks)] = t
                attention[out, pos:pos + len(toks)] = 1
                labels[out, pos + n_prompt:pos + len(toks)] = t[n_prompt:]
                pos += len(toks)
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    def __repr__(self) -> str:
        return (f"InstructionBatcher({self.num_examples} examples, seq_len={self.seq_len}, "
                f"global_batch_size={self.global_batch_size}, seed={self.seed}, pack={self.pack})")
