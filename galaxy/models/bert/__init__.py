"""BERT: the module (``model``), its HF conversion (``hf``) and the family object (``family``, ``BERT``)."""

from galaxy.models.bert.family import BERT, BertFamily
from galaxy.models.bert.model import (BertForMaskedLM, BertForSequenceClassification, BertLayer, BertModel,
                                      BertPreTrainedModel)

__all__ = ["BERT", "BertFamily", "BertForMaskedLM", "BertForSequenceClassification", "BertLayer", "BertModel",
           "BertPreTrainedModel"]
