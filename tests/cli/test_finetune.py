"""LLaMA instruction fine-tuning: the model learns the shipped sample and says a trained answer back;
the CLI on the shipped configs, its launch modes and its bad-input errors."""

import json
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models.llama import LlamaForCausalLM
from galaxy.data.batching import IGNORE_INDEX
from galaxy.data.instruction import InstructionBatcher, format_prompt, load_instruction_data
from galaxy.data.tokenizer import ByteTokenizer
from galaxy.cli.finetune import DEFAULT_LLAMA, main
from galaxy.train.finetune import (DEFAULT_DATA, check_prompt_length, encode_prompt, finetune_tokenizer, greedy_answer,
                                   instruction_batches, match_vocab, pad_batch, shards_sequence)
from galaxy.train.loop import train
from tests import REPO  # noqa: E402
from tests.in_process import run_script

ROOT = REPO
FAST = ["--max_steps", "2", "--no_progress", "--override", "global_batch_size=4"]


def run(args, timeout=240):
    """``python args``, in this process (tests.in_process: the script as __main__, its ranks processes of their own;
    a new interpreter for the launcher would only import torch and Galaxy again)."""
    return run_script(args, timeout=timeout)


def tiny_cfg(**overrides):
    return GalaxyConfig.from_dict(DEFAULT_LLAMA, dict({"plan": "none"}, **overrides))


# ----------------------------------------------------------------------------- behaviour


def test_finetuning_drives_the_loss_down_and_the_model_says_a_trained_answer():
    examples = load_instruction_data(DEFAULT_DATA)
    # Two near-identical prompts (France / Japan) so the answer must come from the instruction.
    subset = [examples[i] for i in (0, 1, 6, 9, 10, 23)]
    target = subset[0]
    assert target["output"] == "The capital of France is Paris."
    cfg = tiny_cfg(max_steps=150, global_batch_size=4, warmup_steps=10)
    tokenizer = ByteTokenizer()
    match_vocab(cfg, tokenizer)
    batcher = InstructionBatcher(subset, tokenizer, cfg.train.seq_length, cfg.train.global_batch_size,
                                 seed=cfg.train.seed)
    ctx = ParallelContext.serial()
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(1), ctx, seed=cfg.train.seed)
    untrained = greedy_answer(model, tokenizer, target["instruction"], max_new_tokens=40)
    assert not untrained.startswith(target["output"])

    result = train(model, instruction_batches(batcher), cfg, ctx)

    losses = result.losses
    assert len(losses) == 150
    assert sum(losses[-10:]) / 10 < 0.1 * sum(losses[:10]) / 10, (losses[:10], losses[-10:])
    answer = greedy_answer(model, tokenizer, target["instruction"], max_new_tokens=40)
    assert answer.startswith(target["output"]), answer
    other = greedy_answer(model, tokenizer, subset[1]["instruction"], max_new_tokens=40)
    assert other.startswith("The capital of Japan is Tokyo."), other


# ----------------------------------------------------------------------------- pieces


def test_sequence_parallel_plans_get_batches_of_seq_length():
    cfg = tiny_cfg()
    tokenizer = ByteTokenizer()
    batcher = InstructionBatcher(load_instruction_data(DEFAULT_DATA)[:6], tokenizer, cfg.train.seq_length, 4)
    loose, fixed = instruction_batches(batcher)(0), instruction_batches(batcher, cfg.train.seq_length)(0)
    width = loose["input_ids"].shape[1]
    assert width < cfg.train.seq_length and fixed["input_ids"].shape == (4, cfg.train.seq_length)
    for key, fill in (("input_ids", tokenizer.pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        assert torch.equal(fixed[key][:, :width], loose[key])
        assert (fixed[key][:, width:] == fill).all()
    half = instruction_batches(batcher, cfg.train.seq_length)(0, shard=(1, 2))  # data-parallel rows pass through
    assert torch.equal(half["input_ids"], fixed["input_ids"][2:])
    with pytest.raises(ValueError, match="must fit in 8"):
        pad_batch(loose, 8, tokenizer.pad_id)
    assert shards_sequence(GalaxyConfig.from_dict(DEFAULT_LLAMA, {"plan": "galaxy"}).resolve_plan(2))
    assert not shards_sequence(GalaxyConfig.from_dict(DEFAULT_LLAMA, {"plan": "tp"}).resolve_plan(2))
    assert not shards_sequence(GalaxyConfig.from_dict(DEFAULT_LLAMA, {"plan": "sp"}).resolve_plan(1))


# A LLaMA whose 8 query / 4 key-value heads and 96-wide MLP split over 2 and 3 ranks, evenly and not.
# The Alpaca prompt below is 159 byte tokens; plans that shard the sequence prefill 224, left-padded,
# so with the uneven split rank 0 holds only padding.
ANSWER_MODEL = {"preset": "llama-tiny", "vocab_size": 259, "hidden_size": 64, "num_attention_heads": 8,
                "num_key_value_heads": 4, "intermediate_size": 96, "seq_length": 224}
UNEVEN_3 = {"tp_num_attention_heads_list": [2, 4, 2], "tp_intermediate_size_list": [24, 48, 24],
            "seq_scatter_list": [48, 100, 76]}
QUESTION = "What do bees make?"


def answer_on_plan(ctx, plan, uneven=False):
    cfg = GalaxyConfig.from_dict(ANSWER_MODEL, dict({"plan": plan}, **(UNEVEN_3 if uneven else {})))
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double()
    return greedy_answer(model, ByteTokenizer(), QUESTION, max_new_tokens=12)


@pytest.mark.parametrize("plan,world,uneven", [("tp", 2, False), ("sp", 2, False), ("galaxy", 2, False),
                                               ("galaxy2", 2, False), ("sp", 3, True), ("galaxy", 3, True),
                                               ("galaxy2", 3, True)])
def test_every_plan_answers_as_the_serial_model(dist_pool, plan, world, uneven):
    """Every plan generates in place with the KV cache (SP ones prefill the left-padded prompt) and
    every rank gets the serial model's answer (float64, so no rounding can flip a greedy choice)."""
    serial = answer_on_plan(ParallelContext.serial(), "none")
    assert len(serial) > 0
    assert dist_pool.run(answer_on_plan, world, plan, uneven) == [serial] * world


def test_the_serial_answer_is_transformers_greedy_answer(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = GalaxyConfig.from_dict(ANSWER_MODEL, {"plan": "none"})
    model = LlamaForCausalLM(cfg.model, seed=3)
    model.save_pretrained(str(tmp_path))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path))
    tokenizer = ByteTokenizer()
    ids = torch.tensor([encode_prompt(tokenizer, QUESTION)])
    out = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_id,
                      pad_token_id=tokenizer.eos_id)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_id in out:
        out = out[:out.index(tokenizer.eos_id)]
    assert greedy_answer(model, tokenizer, QUESTION, max_new_tokens=12) == tokenizer.decode(out)


class NewTensorBytes(TorchDispatchMode):
    """The peak of the bytes held by the storages that ops create while the mode is on, each counted
    until it is freed (storages that existed before, such as the parameters', are not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage pointer -> bytes
        self.now = self.peak = 0

    def _freed(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr)

    @staticmethod
    def _storage(t):
        """A tensor's storage, or None for one without data (a wrapper subclass)."""
        try:
            storage = t.untyped_storage()
            return storage if storage.nbytes() and storage.data_ptr() else None
        except (RuntimeError, NotImplementedError):
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                  for s in [self._storage(a)] if s is not None}
        for t in tree_flatten(out)[0]:
            storage = self._storage(t) if isinstance(t, torch.Tensor) else None
            if storage is None or storage.data_ptr() in self.live or storage.data_ptr() in inputs:
                continue  # no data, counted already, in place, or a view of an input
            self.live[storage.data_ptr()] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, storage.data_ptr())
        return out


def peak_new_bytes(fn) -> int:
    with NewTensorBytes() as mode:
        fn()
    return mode.peak


def answer_memory(ctx, plan):
    """Bytes the answer needs beside the model, against the whole model's (gathered) weights."""
    cfg = GalaxyConfig.from_dict(ANSWER_MODEL, {"plan": plan, "hidden_size": 512, "intermediate_size": 1024,
                                                 "num_hidden_layers": 4})
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3)
    answer = peak_new_bytes(lambda: greedy_answer(model, ByteTokenizer(), QUESTION, max_new_tokens=8))
    copy = peak_new_bytes(lambda: LlamaForCausalLM(cfg.model).load_full_state_dict(model.full_state_dict()))
    full = sum(t.numel() * t.element_size() for t in model.full_state_dict().values())
    return answer, copy, full


@pytest.mark.parametrize("plan", ["sp", "galaxy"])
def test_answering_on_a_plan_holds_no_copy_of_the_model(dist_pool, plan):
    for answer, copy, full in dist_pool.run(answer_memory, 2, plan):
        assert copy >= full  # the measure sees a serial copy of the model when one is made
        assert answer < 0.25 * full, (answer, full)  # the prefill's activations and the KV cache


def test_a_prompt_longer_than_the_sequence_split_is_a_config_error():
    plan = GalaxyConfig.from_dict(ANSWER_MODEL, {"plan": "galaxy"}).resolve_plan(2)
    check_prompt_length(224, plan)
    with pytest.raises(ConfigError, match="the prompt is 225 tokens but plan 'galaxy' splits a sequence of 224"):
        check_prompt_length(225, plan)
    check_prompt_length(225, GalaxyConfig.from_dict(ANSWER_MODEL, {"plan": "tp"}).resolve_plan(2))  # no split


def test_vocab_follows_the_tokenizer_and_a_checkpoint_must_match_it(tmp_path, caplog):
    cfg = tiny_cfg(vocab_size=512)
    match_vocab(cfg, ByteTokenizer())
    assert cfg.model.vocab_size == 259 and "vocab_size set to 259" in caplog.text
    saved = GalaxyConfig.from_dict(DEFAULT_LLAMA, {"vocab_size": 300, "hidden_size": 32})
    LlamaForCausalLM(saved.model, seed=1).save_pretrained(str(tmp_path))
    cfg = tiny_cfg(model_path=str(tmp_path))
    with pytest.raises(ValueError, match="300-token vocabulary but no tokenizer was given"):
        match_vocab(cfg, ByteTokenizer())


def test_fine_tuning_starts_from_a_local_checkpoint(tmp_path, capsys):
    cfg = tiny_cfg(hidden_size=32)
    LlamaForCausalLM(cfg.model, seed=1).save_pretrained(str(tmp_path))
    assert main(["--model_path", str(tmp_path), "--no_progress", "--max_steps", "2", "--override",
                 "global_batch_size=2", "--prompt", "What do bees make?", "--max_new_tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "fine-tuning summary" in out and "answer" in out


def save_word_tokenizer(directory):
    """A small offline HF tokenizer (words of the shipped sample, with BOS/EOS/PAD); returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [format_prompt(e["instruction"], e["input"]) + e["output"] for e in load_instruction_data(DEFAULT_DATA)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(directory))
    return len(fast)


def test_a_checkpoint_with_its_own_tokenizer_fine_tunes_without_flags(tmp_path, capsys):
    size = save_word_tokenizer(tmp_path)
    cfg = tiny_cfg(vocab_size=size, hidden_size=32)
    LlamaForCausalLM(cfg.model, seed=1).save_pretrained(str(tmp_path))
    summary = tmp_path / "s.json"
    assert main(["--model_path", str(tmp_path), "--no_progress", "--max_steps", "2", "--override",
                 "global_batch_size=2", "--summary_json", str(summary)]) == 0
    fields = json.loads(summary.read_text())
    assert fields["vocab_size"] == size and "HFTokenizer" in fields["tokenizer"]
    # A fresh model takes the tokenizer's size; a checkpoint with fewer rows than the tokenizer is refused.
    fresh = tiny_cfg(tokenizer=str(tmp_path))
    match_vocab(fresh, finetune_tokenizer(fresh))
    assert fresh.model.vocab_size == size
    small = tmp_path / "small"
    LlamaForCausalLM(tiny_cfg(vocab_size=size - 5, hidden_size=32).model, seed=1).save_pretrained(str(small))
    assert main(["--model_path", str(small), "--tokenizer", str(tmp_path)]) == 2
    assert f"the tokenizer has {size} tokens but the checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("config,world", [
    ("train_config/llama/full.json", 1),
    ("train_config/llama/tp/full.json", 2),
    ("train_config/llama/galaxy/full.json", 2),
])
def test_shipped_configs_run(tmp_path, config, world):
    metrics = tmp_path / "m.jsonl"
    summary = tmp_path / "s.json"
    args = ["finetune_llama.py", "--config", config, "--world", str(world), "--metrics_file", str(metrics),
            "--summary_json", str(summary), "--prompt", "What do bees make?", "--max_new_tokens", "4"]
    out = run(args + FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fine-tuning summary" in out.stdout
    assert [json.loads(l)["step"] for l in metrics.read_text().splitlines()] == [1, 2]
    fields = json.loads(summary.read_text())
    assert fields["world"] == world and fields["vocab_size"] == 259 and isinstance(fields["answer"], str)
    for key in ("first_loss", "final_loss", "tokens_per_s", "step_time_s", "peak_mem_mb"):
        assert fields[key] is not None
    plan = json.loads(open(os.path.join(ROOT, config)).read())["parallel"]["plan"]
    assert fields["plan"] == plan
    if plan == "galaxy":
        assert fields["seq_split"] == [160, 160]


@pytest.mark.parametrize("config", ["train_config/llama/pp/full.json", "train_config/llama/pp/lora.json"])
def test_pipeline_cli_runs_the_shipped_configs(config):
    out = run(["finetune_pp_llama.py", "--config", config, "--world", "2"] + FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fine-tuning summary" in out.stdout


def test_config_scales_to_llama_1b_by_override():
    cfg = GalaxyConfig.from_file(os.path.join(ROOT, "train_config/llama/galaxy/full.json"),
                                 {"preset": "llama-1b", "seq_length": 2048})
    plan = cfg.resolve_plan(2)
    assert cfg.model.hidden_size == 2048 and cfg.model.num_hidden_layers == 16
    assert plan.heads_split == (16, 16) and plan.seq_split == (1024, 1024)


@pytest.mark.parametrize("argv,needle", [
    (["--data", "missing.jsonl"], "instruction data file not found"),
    (["--override", "model_type=bert"], "this CLI fine-tunes causal LMs"),
    (["--config", "train_config/llama/tp/full.json", "--world", "3"], "splits a group of 2 query heads"),
    (["--model_path", "no/such/dir"], "has no config.json"),
    (["--tokenizer", "no/such/dir"], "does not exist or is not a directory"),
    (["--override", "seq_length=100"], "no response fits; raise seq_len"),
    (["--override", "seq_length=1000"], "exceeds max_position_embeddings"),
    (["--max_new_tokens", "-1"], "--max_new_tokens must be non-negative"),
    (["--world", "2", "--rank", "2"], "--rank 2 is outside --world 2"),
    (["--config_file", "train_config/llama/galaxy/full.json", "--world", "2", "--override",
      "seq_scatter_list=[100,100]"], "sums to 200 but seq_length is 320"),
    (["--override", "hiden_size=64"], "did you mean 'hidden_size'"),
    (["--world", "2", "--prompt", "a" * 200], "the prompt is 341 tokens but plan 'galaxy' splits a sequence of 320"),
])
def test_bad_input_is_one_clear_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_help_lists_the_fine_tuning_flags():
    out = run(["finetune_llama.py", "--help"])
    for flag in ("--config_file", "--config", "--world", "--rank", "--max_steps", "--seed", "--metrics_file",
                 "--model_path", "--data", "--tokenizer", "--override", "--prompt", "--max_new_tokens", "--pack"):
        assert flag in out.stdout
