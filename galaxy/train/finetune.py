"""Instruction fine-tuning of LLaMA on any plan: the pieces ``finetune_llama.py`` (galaxy.cli.finetune)
puts together, usable on their own:

* :func:`finetune_tokenizer` / :func:`match_vocab`: the tokenizer (a local HF directory, the
  checkpoint's own directory when it holds one, or the offline byte-level fallback) and a model
  vocabulary that fits it (a fresh model takes the tokenizer's size; a checkpoint must match).
* :func:`instruction_batches`: ``batch_at(step, shard=None)`` over :class:`InstructionBatcher`,
  padded to ``seq_length`` when the plan shards the sequence (SP needs ``seq == sum(seq_split)``).
* :func:`greedy_answer`: the model's greedy reply to an Alpaca prompt, generated in place on any
  plan with the KV cache (plans that shard the sequence prefill the prompt left-padded to their split).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Optional

import torch

from galaxy.config import COMPUTE_KEYS, ConfigError, GalaxyConfig, Method, Plan
from galaxy.data.batching import IGNORE_INDEX
from galaxy.data.instruction import InstructionBatcher, format_prompt
from galaxy.data.tokenizer import ByteTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(ROOT, "data", "alpaca_sample.jsonl")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


# ----------------------------------------------------------------------------- tokenizer and vocabulary


def finetune_tokenizer(cfg: GalaxyConfig):
    """``data.tokenizer``; else the ``model_path`` directory when it holds a tokenizer; else bytes."""
    directory = cfg.data.tokenizer
    model_path = cfg.data.model_path
    if directory is None and model_path and any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        logger.info("using the tokenizer saved with the checkpoint in %s", model_path)
        directory = model_path
    tokenizer = load_tokenizer(directory)
    if directory is None:
        logger.info("no tokenizer directory given: using the offline byte-level tokenizer (vocab %d)",
                    tokenizer.vocab_size)
    return tokenizer


def checkpoint_model_config(path: str):
    """The ``ModelConfig`` of a local HF causal-LM checkpoint (any causal family of the registry),
    checking its files are there."""
    from galaxy.models import family, hf_model_class, model_types

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"model_path '{path}' has no config.json; point it at a local HF model directory")
    files = os.listdir(path)
    if not any(f.endswith(".safetensors") or (f.startswith("pytorch_model") and f.endswith(".bin")) for f in files):
        raise FileNotFoundError(f"model_path '{path}' holds no *.safetensors or pytorch_model*.bin weights")
    with open(config_file) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"model_path '{path}': config.json is not valid JSON: {e}") from None
    cls = hf_model_class(hf, f"model_path '{path}'")
    if not family(cls.model_type).causal:
        raise ConfigError(f"model_path '{path}' holds a {cls.model_type} model, which is no causal LM; instruction "
                          "fine-tuning needs one of " + ", ".join(model_types(causal=True)))
    return cls.config_from_hf(hf)


def match_vocab(cfg: GalaxyConfig, tokenizer) -> None:
    """Make ``cfg.model`` fit the tokenizer (in place).

    A fresh model takes the tokenizer's vocabulary size (a warning when the config said otherwise).
    With ``model_path`` the model section becomes the checkpoint's (so the plan splits its real
    shapes); its vocabulary is fixed, so a tokenizer with more ids, or the byte-level fallback on a
    checkpoint of another vocabulary, is an error that says to pass ``--tokenizer``.
    """
    size = tokenizer.vocab_size
    if cfg.data.model_path:
        compute = {k: getattr(cfg.model, k) for k in COMPUTE_KEYS}  # how to run it stays the config's choice
        cfg.model = checkpoint_model_config(cfg.data.model_path)
        for key, value in compute.items():
            setattr(cfg.model, key, value)
        vocab = cfg.model.vocab_size
        if isinstance(tokenizer, ByteTokenizer) and vocab != size:
            raise ConfigError(f"the checkpoint in '{cfg.data.model_path}' has a {vocab}-token vocabulary but no "
                              f"tokenizer was given and the byte-level fallback has {size}; pass --tokenizer "
                              "with the checkpoint's tokenizer directory")
        if size > vocab:
            raise ConfigError(f"the tokenizer has {size} tokens but the checkpoint in '{cfg.data.model_path}' "
                              f"embeds only {vocab}; pass --tokenizer with the checkpoint's own tokenizer")
        if size < vocab:
            logger.info("the tokenizer uses %d of the checkpoint's %d embedding rows", size, vocab)
    elif cfg.model.vocab_size != size:
        logger.warning("vocab_size set to %d to match the tokenizer %r (config had %d)", size, tokenizer,
                       cfg.model.vocab_size)
        cfg.model.vocab_size = size
    cfg.validate()  # seq_length against the (checkpoint's) max_position_embeddings, among others


# ----------------------------------------------------------------------------- batches


def shards_sequence(plan: Plan) -> bool:
    """Whether the plan splits the sequence over ranks (then every batch must be ``sum(seq_split)`` long)."""
    return plan.size > 1 and Method.SP in (plan.att, plan.con, plan.mlp)


def pad_batch(batch: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` (with ``pad_id``), ``attention_mask`` (0) and ``labels`` (-100) to ``length``."""
    width = batch["input_ids"].shape[1]
    if width > length:
        raise ValueError(f"a batch is {width} tokens wide but must fit in {length}")
    if width == length:
        return batch
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    out = {}
    for key, value in batch.items():
        pad = value.new_full((value.shape[0], length - width), fill.get(key, 0))
        out[key] = torch.cat([value, pad], dim=1)
    return out


def instruction_batches(batcher: InstructionBatcher, fixed_length: Optional[int] = None
                        ) -> Callable[..., dict[str, torch.Tensor]]:
    """``batch_at(step, shard=None)`` for the training loop: the batcher's batch, right-padded to
    ``fixed_length`` when given (sequence-parallel plans; see :func:`shards_sequence`)."""
    pad_id = batcher.tokenizer.pad_id

    def batch_at(step: int, shard: Optional[tuple[int, int]] = None) -> dict[str, torch.Tensor]:
        batch = batcher.batch_at(step, shard)
        return batch if fixed_length is None else pad_batch(batch, fixed_length, pad_id)

    return batch_at


# ----------------------------------------------------------------------------- generation


def encode_prompt(tokenizer, instruction: str, input: str = "") -> list[int]:  # noqa: A002 (Alpaca's name)
    """The token ids a trained model saw before its response: ``[BOS] format_prompt(...)``."""
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    return bos + list(tokenizer.encode(format_prompt(instruction, input)))


def check_prompt_length(tokens: int, plan: Plan) -> None:
    """A plan that shards the sequence prefills at most ``sum(seq_split)`` (``seq_length``) tokens."""
    if shards_sequence(plan) and tokens > sum(plan.seq_split):
        raise ConfigError(f"the prompt is {tokens} tokens but plan '{plan.name}' splits a sequence of "
                          f"{sum(plan.seq_split)} (seq_length); raise seq_length to at least {tokens} or shorten "
                          "the prompt")


def prompt_for_plan(ids: list[int], plan: Plan, pad_id: int, device=None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(input_ids [1, s], attention_mask or None)``: the prompt as the plan's prefill takes it. A
    plan that shards the sequence splits a fixed ``sum(seq_split)`` tokens (``seq_length``), so the
    prompt is left-padded to it and masked (positions then count real tokens only, so the answer is
    the unpadded prompt's); other plans take it as it is."""
    check_prompt_length(len(ids), plan)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    if not shards_sequence(plan):
        return prompt, None
    pad = sum(plan.seq_split) - len(ids)
    mask = torch.cat([prompt.new_zeros(1, pad), torch.ones_like(prompt)], dim=1)
    return torch.cat([prompt.new_full((1, pad), pad_id), prompt], dim=1), mask


def greedy_answer(model, tokenizer, instruction: str, input: str = "",  # noqa: A002
                  max_new_tokens: int = 64) -> str:
    """The model's greedy response to the Alpaca prompt of ``instruction`` (and ``input``), decoded
    up to its EOS.

    A collective: every rank of the model's mp group must call it. Every plan generates in place
    with the KV cache (``LlamaForCausalLM.generate``; the ranks share each chosen token), so no rank
    holds more than its own shards; every rank returns the text."""
    ids = encode_prompt(tokenizer, instruction, input)
    limit = model.config.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        logger.warning("prompt (%d tokens) + max_new_tokens (%d) exceeds max_position_embeddings (%d)",
                       len(ids), max_new_tokens, limit)
    pad_id = tokenizer.pad_id if getattr(tokenizer, "pad_id", None) is not None else tokenizer.eos_id
    prompt, mask = prompt_for_plan(ids, model.plan, pad_id, model.ctx.device)
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_id)[0, prompt.shape[1]:].tolist()
    if tokenizer.eos_id in out:
        out = out[:out.index(tokenizer.eos_id)]
    return tokenizer.decode(out)
