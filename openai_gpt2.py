"""OpenAI's GPT-2 and transformers: its weights into our GPT (train_gpt2.py's from_pretrained) and
our checkpoints out as a transformers GPT2LMHeadModel directory (the export command).

Both ways are a renaming-free copy: our parameter names are GPT-2's, and only the four matmuls that
transformers keeps as Conv1D, (in, out), are transposed. Our vocabulary is padded to a multiple of
64 with rows that are zero on the way in and dropped on the way out. Nothing here downloads at
import; torch and transformers are imported where needed.
"""

import math
import os

from common import UsageError, hub_unreachable, one_line
import chat
import tokenizer
from fineweb import BPE_DIR, EOT, _gpt2_byte_chars

OPENAI_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# the matmuls transformers' GPT-2 keeps as Conv1D, (in, out): transposed on import and export
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
PAD_VOCAB_TO = 64  # 50257 -> 50304: matmuls over a multiple of 64 are faster


def hub_name(name):
    """The hub repository for ``name``: OpenAI's short names map to ``openai-community/<name>``."""
    return f"openai-community/{name}" if name in OPENAI_MODELS else name


def _from_hub(name, what, load):
    """load(source, local_files_only) for a hub name or a local save_pretrained directory; a
    one-line UsageError if it cannot be loaded, in seconds when the hub is out of reach (its
    client would retry for minutes)."""
    from huggingface_hub import try_to_load_from_cache

    local = os.path.isdir(name)
    source = name if local else hub_name(name)
    offline = not local and hub_unreachable()  # then only a copy in the local cache can load
    why = "the hub is unreachable and it is not in the local cache"
    try:
        if offline and not isinstance(try_to_load_from_cache(source, "config.json"), str):
            raise LookupError(why)
        return load(source, offline)
    except Exception as e:  # not cached, an unknown name, not a model directory, damaged weights
        if not offline:
            first = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
        message = (f"could not load GPT-2 {what} {name!r} from {source} ({why}); offline, pass a "
                   f"local directory written by GPT2LMHeadModel.save_pretrained")
        raise UsageError(one_line(message, 10_000)) from None


def load_hf_model(name):
    """transformers' own ``GPT2LMHeadModel`` (fp32, eval mode) from a hub name or a local
    save_pretrained directory; a one-line UsageError if it can't be loaded."""
    def load(source, offline):
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel.from_pretrained(source, local_files_only=offline)
    return _from_hub(name, "model", load).float().eval()


def config_of(hc, name):
    """The GPTConfig keywords of a transformers GPT2Config, or a UsageError if it is not GPT-2's
    standard architecture (another activation, LayerNorm eps, MLP width or attention scaling)."""
    standard = (hc.activation_function == "gelu_new" and hc.layer_norm_epsilon == 1e-5
                and hc.n_inner in (None, 4 * hc.n_embd)
                and not getattr(hc, "scale_attn_by_inverse_layer_idx", False)
                and not getattr(hc, "reorder_and_upcast_attn", False))
    if hc.model_type != "gpt2" or not standard:
        raise UsageError(f"{name}: not a standard GPT-2 architecture")
    padded_vocab = math.ceil(hc.vocab_size / PAD_VOCAB_TO) * PAD_VOCAB_TO
    return dict(block_size=hc.n_positions, vocab_size=padded_vocab, n_layer=hc.n_layer,
                n_head=hc.n_head, n_embd=hc.n_embd, real_vocab_size=hc.vocab_size)


def pretrained_config(name):
    """config_of the GPT-2 model `name` (its config.json alone: the weights stay where they are)."""
    def load(source, offline):
        from transformers import GPT2Config
        return GPT2Config.from_pretrained(source, local_files_only=offline)
    return config_of(_from_hub(name, "config", load), name)


def pretrained_state_dict(name):
    """(GPTConfig keywords, state dict in our layout) of the GPT-2 model `name`: Conv1D weights
    transposed, the embedding and head padded with zero rows to the padded vocab."""
    import torch.nn.functional as F

    hf = load_hf_model(name)
    config = config_of(hf.config, name)
    padding = config["vocab_size"] - config["real_vocab_size"]
    sd = {}
    for k, v in hf.state_dict().items():
        if k.endswith(CONV1D_WEIGHTS):
            v = v.t()  # HF's Conv1D is (in, out); nn.Linear wants (out, in)
        if k in ("transformer.wte.weight", "lm_head.weight"):  # zero padding rows: masked
            v = F.pad(v, (0, 0, 0, padding))
        sd[k] = v
    return config, sd


def export_hf(model, out_dir, tok=None):
    """Write a GPT (train_gpt2.py's) as a transformers GPT2LMHeadModel directory, the vocab
    unpadded, with its tokenizer (export_tokenizer): what `train_gpt2.py export` makes of a
    checkpoint. A chat model's turn ends at <|assistant_end|>: its eos token, where generate()
    stops. tok: the model's tokenizer.Tokenizer (None: GPT-2's BPE)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    if c.gpt2_differences():
        raise UsageError(f"only GPT-2's architecture exports to GPT2LMHeadModel: this model has "
                         f"{', '.join(c.gpt2_differences())}")
    talks = chat.is_chat_model(c)
    bos = EOT if tok is None else tok.eot
    eos = bos
    if talks:
        eos = chat.END["assistant"]
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=c.real_vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
        n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, resid_pdrop=c.dropout, embd_pdrop=c.dropout,
        attn_pdrop=c.dropout, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True))
    hf.generation_config.eos_token_id = eos
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k.endswith(CONV1D_WEIGHTS):
            v = v.t()
        if k in ("transformer.wte.weight", "lm_head.weight"):
            v = v[: c.real_vocab_size]
        sd[k] = v.contiguous()
    hf.load_state_dict(sd, strict=True)
    hf.save_pretrained(out_dir)
    export_tokenizer(out_dir, talks, tok)
    return hf


def export_tokenizer(out_dir, talks=False, tok=None):
    """GPT-2's tokenizer (gpt2_bpe/'s two files, under transformers' names) into out_dir, so that
    AutoTokenizer and pipeline() load an exported model's folder as it is. A chat model's (talks)
    also has the six chat tokens at their ids and chat.CHAT_TEMPLATE, so that
    apply_chat_template renders a conversation as chat.render does. tok: a trained
    tokenizer.Tokenizer, written as a tokenizer.json instead (hf_bpe)."""
    import shutil
    import tempfile

    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

    if tok is not None and not tok.gpt2:
        eot = tokenizer.EOT_NAME
        fast = PreTrainedTokenizerFast(tokenizer_object=hf_bpe(tok), bos_token=eot,
                                       eos_token=eot, unk_token=eot)
        fast.save_pretrained(out_dir)
        return fast

    with tempfile.TemporaryDirectory() as files:  # the names from_pretrained reads
        shutil.copy(os.path.join(BPE_DIR, "encoder.json"), os.path.join(files, "vocab.json"))
        shutil.copy(os.path.join(BPE_DIR, "vocab.bpe"), os.path.join(files, "merges.txt"))
        tok = GPT2TokenizerFast.from_pretrained(files)
    if talks:
        tok.add_special_tokens({"additional_special_tokens": list(chat.SPECIAL_TOKENS)})
        tok.chat_template = chat.CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


def _merge_of(ranks, token):
    """The two tokens whose merge made token: its bytes merged as tiktoken would, with only the
    ranks below its own."""
    parts, limit = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not the merge of two tokens of lower rank")
    return parts


def hf_bpe(tok):
    """A trained tokenizer.Tokenizer as HF tokenizers' Tokenizer, the same ids as its tiktoken
    encoding: GPT-2's byte-to-character spelling, the merges in rank order, a piece that is a
    token taken whole as tiktoken takes it (ignore_merges), the split pattern, the special
    tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    char_of = {byte: char for char, byte in _gpt2_byte_chars().items()}

    def spell(token):
        return "".join(char_of[b] for b in token)

    vocab = {spell(token): rank for token, rank in tok.ranks.items()}
    merges = [tuple(spell(part) for part in _merge_of(tok.ranks, token))
              for token, rank in sorted(tok.ranks.items(), key=lambda item: item[1])
              if rank >= 256]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.special_tokens.items(), key=lambda item: item[1])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False)
                           for name, _ in specials])
    return hf
