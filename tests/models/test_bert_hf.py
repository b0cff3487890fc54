"""Serial BERT equals transformers on the same weights, both ways through HF directories."""

import pytest
import torch
from transformers import BertConfig
from transformers import BertForMaskedLM as HFBertForMaskedLM
from transformers import BertForSequenceClassification as HFBertForSequenceClassification

from galaxy.models.bert.model import BertForMaskedLM, BertForSequenceClassification

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)


def inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 99, (3, 13), generator=g)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 9:] = 0
    types = torch.zeros_like(ids)
    types[:, 7:] = 1
    labels = torch.where(torch.rand(3, 13, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types), labels


@pytest.mark.parametrize("safe", [True, False])
def test_masked_lm_matches_transformers(tmp_path, safe):
    torch.manual_seed(0)
    hf = HFBertForMaskedLM(BertConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path / "hf")
    if not safe:  # the older torch-pickle layout, which we read with weights_only=True
        (tmp_path / "hf" / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    ours = BertForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()
    x, labels = inputs()
    ref, out = hf(**x, labels=labels), ours(**x, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)

    ours.save_pretrained(str(tmp_path / "ours"))
    back = HFBertForMaskedLM.from_pretrained(str(tmp_path / "ours")).eval()
    torch.testing.assert_close(back(**x).logits, out.logits, rtol=1e-5, atol=1e-5)


def test_sequence_classification_matches_transformers(tmp_path):
    torch.manual_seed(1)
    hf = HFBertForSequenceClassification(BertConfig(**TINY, num_labels=3)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = BertForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    x, _ = inputs()
    labels = torch.tensor([0, 2, 1])
    ref, out = hf(**x, labels=labels), ours(**x, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    ours.save_pretrained(str(tmp_path / "ours"))
    back = HFBertForSequenceClassification.from_pretrained(str(tmp_path / "ours")).eval()
    torch.testing.assert_close(back(**x).logits, out.logits, rtol=1e-5, atol=1e-5)


def test_random_init_follows_hf_statistics():
    from galaxy.config import ModelConfig

    model = BertForMaskedLM(ModelConfig(**{k: v for k, v in TINY.items()}), seed=5)
    w = model.bert.encoder.layer[0].attention.self.query.weight
    assert abs(w.std().item() - 0.02) < 0.004 and w.mean().abs().item() < 0.005
    assert torch.all(model.bert.embeddings.word_embeddings.weight[0] == 0)  # padding row
    assert torch.all(model.bert.encoder.layer[0].output.LayerNorm.weight == 1)
    same = BertForMaskedLM(ModelConfig(**TINY), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))


def test_bad_checkpoints_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        BertForMaskedLM.from_pretrained(str(tmp_path))
    hf = HFBertForMaskedLM(BertConfig(**TINY))
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        BertForMaskedLM.from_pretrained(str(tmp_path / "hf"))


def test_config_json_round_trips_through_transformers():
    """``galaxy.models.bert.hf``: the config.json Galaxy writes is what transformers' ``BertConfig`` reads
    back key for key, and transformers' own config.json reads into the same model config."""
    from galaxy.config import ModelConfig
    from galaxy.models.bert.hf import HF_KEYS

    ours = ModelConfig(**dict(TINY, hidden_act="gelu_new", layer_norm_eps=1e-7, num_labels=3))
    written = BertForSequenceClassification.hf_config(ours)
    hf = BertConfig(**written).to_dict()
    assert {k: hf[k] for k in HF_KEYS} == {k: getattr(ours, k) for k in HF_KEYS}
    hf["id2label"] = {i: f"L{i}" for i in range(3)}
    back = BertForSequenceClassification.config_from_hf(hf)
    assert {k: getattr(back, k) for k in HF_KEYS} == {k: getattr(ours, k) for k in HF_KEYS} and back.num_labels == 3
    with pytest.raises(ValueError, match="'llama' model, not BERT"):
        BertForSequenceClassification.config_from_hf(dict(hf, model_type="llama"))
