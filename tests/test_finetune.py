"""LLaMA instruction fine-tuning: the model learns the shipped sample and says a trained answer back;
the CLI on the shipped configs, its launch modes and its bad-input errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models.llama import LlamaForCausalLM
from galaxy.data.batching import IGNORE_INDEX
from galaxy.data.instruction import InstructionBatcher, format_prompt, load_instruction_data
from galaxy.data.tokenizer import ByteTokenizer
from galaxy.cli.finetune import DEFAULT_LLAMA, main
from galaxy.train.finetune import (DEFAULT_DATA, finetune_tokenizer, greedy_answer, instruction_batches, match_vocab,
                                   pad_batch, shards_sequence)
from galaxy.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--max_steps", "2", "--no_progress", "--override", "global_batch_size=4"]


def run(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


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

    result = train(model, instruction_batches(batcher), cfg, ctx, progress=False)

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


def answer_on_plan(ctx, plan):
    cfg = GalaxyConfig.from_dict(DEFAULT_LLAMA, {"plan": plan})
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3)
    return greedy_answer(model, ByteTokenizer(), "What do bees make?", max_new_tokens=12)


@pytest.mark.parametrize("plan", ["tp", "galaxy", "sp"])
def test_every_plan_answers_as_the_serial_model(dist_pool, plan):
    """TP generates in place on every rank; plans that shard the sequence gather a serial copy on rank 0."""
    serial = answer_on_plan(ParallelContext.serial(), "none")
    answers = dist_pool.run(answer_on_plan, 2, plan)
    assert answers[0] == serial
    assert answers[1] == (serial if plan == "tp" else None)


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
    (["--override", "model_type=bert"], "this CLI fine-tunes LLaMA"),
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
