"""The transformers model of a checkpoint that is not GPT-2's architecture (--arch modern, or any
part flag): the modeling code of the folder that `train_gpt2.py export` writes, which
AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) runs.

In the repository, hf_modeling.py is a template that imports the model from train_gpt2 (and runs
as it is); export writes it into the folder as modeling_fineweb_gpt.py with that import replaced
by the source of what it imports and of what that uses in turn (openai_gpt2.modeling_source). So
the folder's model is train_gpt2.py's own code, not a copy kept in step by hand, and the folder
needs nothing of the repository: PyTorch and transformers only.

The wrapper is thin: the weights are GPT's under `model.`, the config is GPTConfig's fields, and
generate() runs without a KV cache (each new token runs the whole sequence again: exact, and
slower on long outputs than `train_gpt2.py sample`, which keeps one; `model.model.generate` is
GPT's own, with its KV cache and top-k sampling).
"""
from __future__ import annotations  # the model code's annotations (GPTConfig) stay unevaluated

import torch.nn.functional as F
import transformers
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from train_gpt2 import GPT, config_buffers  # export: replaced by their source

MODEL_TYPE = "fineweb_gpt"


class FineWebGPTConfig(PretrainedConfig):
    """train_gpt2.GPTConfig's fields, as export wrote them into config.json; transformers' usual
    names (hidden_size, num_hidden_layers, ...) read them too."""

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
                     "max_position_embeddings": "block_size"}


class FineWebGPTForCausalLM(PreTrainedModel, GenerationMixin):
    """train_gpt2.GPT as a transformers causal LM: logits over the real vocabulary (the padding
    ids, never predicted, left out), the loss of labels as transformers' causal LMs take them."""

    config_class = FineWebGPTConfig
    base_model_prefix = "model"
    _supports_cache_class = False
    # tied (--tie_embeddings): one tensor, saved once as the input embedding; transformers ties
    # the head to it again after loading
    _tied_weights_keys = {"model.lm_head.weight": "model.transformer.wte.weight"}
    if int(transformers.__version__.split(".")[0]) < 5:  # 4.x: a list of names
        _tied_weights_keys = list(_tied_weights_keys)

    def __init__(self, config):
        super().__init__(config)
        self.model = GPT(config)
        self.post_init()

    def _init_weights(self, module):
        """A module that the weights file does not fill: the buffers its config determines
        (transformers builds the model on the meta device, and buffers are not in the file), and
        GPT's own init of the rest."""
        if isinstance(module, GPT):
            for name, value in config_buffers(module.config).items():
                getattr(module, name).copy_(value)
        else:
            self.model._init_weights(module)

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        """input_ids (B, T) -> logits (B, T, real_vocab_size); labels (B, T), input_ids or -100
        where unscored: the mean cross-entropy of each position's prediction of the next. Every
        row is a whole sequence: there is no padding (nor a KV cache) to mask."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this model takes no padding: give rows of equal length without an "
                             "attention mask of zeros (or one row at a time)")
        logits, _ = self.model(input_ids)
        logits = logits[..., : self.config.real_vocab_size]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten().to(logits.device))
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """Each generate() step runs the whole sequence so far: no KV cache."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

