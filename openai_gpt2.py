"""OpenAI's GPT-2 and transformers: its weights into our GPT (train_gpt2.py's from_pretrained) and
our checkpoints out as a transformers GPT2LMHeadModel directory (the export command).

Both ways are a renaming-free copy: our parameter names are GPT-2's, and only the four matmuls that
transformers keeps as Conv1D, (in, out), are transposed. Our vocabulary is padded to a multiple of
64 with rows that are zero on the way in and dropped on the way out. A model of another
architecture (--arch modern) goes out as a folder with its own modeling code, written from
train_gpt2.py's source (modeling_source), and comes back in as it went out. Nothing here downloads
at import; torch and transformers are imported where needed.
"""

import ast
import builtins
import dis
import inspect
import json
import math
import os
import re

from common import UsageError, atomic_write, hub_unreachable, one_line
import chat
import tokenizer
from fineweb import BPE_DIR, EOT, _gpt2_byte_chars

OPENAI_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# the matmuls transformers' GPT-2 keeps as Conv1D, (in, out): transposed on import and export
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
PAD_VOCAB_TO = 64  # 50257 -> 50304: matmuls over a multiple of 64 are faster
# config.json's key for the flags of the run that trained an exported model (settings.base_flags):
# `sft --init_from DIR` takes its run defaults from them, as from a model_*.pt's args. transformers
# keeps a config key it does not know, also when it saves the folder again.
RUN_KEY = "train_gpt2_run"


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
    """config_of the GPT-2 model `name` (its config.json alone: the weights stay where they are);
    of a folder that export_custom wrote, its GPTConfig keywords but dropout."""
    if custom_config(name) is not None:
        return custom_state_dict(name, weights=False)[0]

    def load(source, offline):
        from transformers import GPT2Config
        return GPT2Config.from_pretrained(source, local_files_only=offline)
    return config_of(_from_hub(name, "config", load), name)


def pretrained_state_dict(name):
    """(GPTConfig keywords, state dict in our layout) of the GPT-2 model `name`: Conv1D weights
    transposed, the embedding and head padded with zero rows to the padded vocab. A folder that
    export_custom wrote: its own (custom_state_dict)."""
    import torch.nn.functional as F

    if custom_config(name) is not None:
        return custom_state_dict(name)
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


def export_hf(model, out_dir, tok=None, run=None):
    """Write a GPT (train_gpt2.py's) as a transformers model directory with its tokenizer
    (export_tokenizer): what `train_gpt2.py export` makes of a checkpoint. GPT-2's architecture
    as a GPT2LMHeadModel, the vocab unpadded; any other (--arch modern, a part flag) as a folder
    with its own modeling code (export_custom). A chat model's turn ends at <|assistant_end|>: its
    eos token, where generate() stops. tok: the model's tokenizer.Tokenizer (None: GPT-2's BPE).
    run: flags of the run that trained it, kept in config.json under RUN_KEY (None: no record)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    record = {RUN_KEY: dict(run)} if run else {}
    tokens = chat.GPT2_TOKENS if tok is None else chat.tokens_of(tok.encoding())
    talks = chat.is_chat_model(c, tokens)
    bos = EOT if tok is None else tok.eot
    eos = bos
    if talks:
        eos = tokens.end["assistant"]
    if c.gpt2_differences():  # no class of transformers' has these parts
        export_custom(model, out_dir, bos, eos, record)
        export_tokenizer(out_dir, talks, tok)
        return None
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=c.real_vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
        n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, resid_pdrop=c.dropout, embd_pdrop=c.dropout,
        attn_pdrop=c.dropout, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True,
        **record))
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
        if talks:  # its chat tokens are among its special tokens already
            fast.chat_template = chat.CHAT_TEMPLATE
        save_tokenizer(fast, out_dir)
        return fast

    with tempfile.TemporaryDirectory() as files:  # the names from_pretrained reads
        shutil.copy(os.path.join(BPE_DIR, "encoder.json"), os.path.join(files, "vocab.json"))
        shutil.copy(os.path.join(BPE_DIR, "vocab.bpe"), os.path.join(files, "merges.txt"))
        tok = GPT2TokenizerFast.from_pretrained(files)
    if talks:
        tok.add_special_tokens({"additional_special_tokens": list(chat.SPECIAL_TOKENS)})
        tok.chat_template = chat.CHAT_TEMPLATE
    save_tokenizer(tok, out_dir)
    return tok


def save_tokenizer(tok, out_dir):
    """tok.save_pretrained(out_dir), readable by transformers 4.x too: 5.x writes the extra
    special tokens as a list under "extra_special_tokens", which 4.x reads as a dict of named
    tokens and fails on; both read the list as "additional_special_tokens"."""
    tok.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        atomic_write(path, lambda f: f.write(text.encode()))


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


# ===== Any other architecture: a model folder with its own modeling code =======================
# transformers has no class for a model with the modern parts: the folder holds its modeling code,
# the template hf_modeling.py with train_gpt2's model code written in, which from_pretrained runs
# when the user allows it (trust_remote_code=True)
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_modeling.py")
MODEL_CODE_IMPORT = re.compile(r"^from train_gpt2 import (.+?)(  #.*)?$", re.M)
LEFT_OUT = {"GPT": ("from_pretrained", "configure_optimizers")}  # need the repository's modules
CUSTOM_TYPE = "fineweb_gpt"  # hf_modeling.MODEL_TYPE
CUSTOM_FILE = "modeling_fineweb_gpt.py"
CUSTOM_CLASSES = {"AutoConfig": "FineWebGPTConfig", "AutoModelForCausalLM": "FineWebGPTForCausalLM"}
CUSTOM_PREFIX = "model."  # the wrapper's GPT: its weights' names in the folder
# what config.json holds besides GPTConfig's fields (transformers adds its own on a save)
CUSTOM_KEYS = ("architectures", "auto_map", "model_type", "tie_word_embeddings", "bos_token_id",
               "eos_token_id", "use_cache", "transformers_version", RUN_KEY)


def _first_line(node):
    """The line (from 1) where a def or class starts: its first decorator's."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def _definition(node, lines, left_out=()):
    """The source of a module's def or class (its ast node; the module's lines), without the
    methods named in left_out."""
    dropped = set()
    for method in node.body:
        if isinstance(method, ast.FunctionDef) and method.name in left_out:
            end = method.end_lineno
            while end < len(lines) and not lines[end].strip():  # and the blank lines after it
                end += 1
            dropped.update(range(_first_line(method) - 1, end))
    kept = (lines[i] for i in range(_first_line(node) - 1, node.end_lineno) if i not in dropped)
    return "".join(kept).rstrip() + "\n"


def _globals_read(obj, node, left_out=()):
    """The global names that a function or class (obj, its ast node) reads: in its code (a
    class: its methods' but left_out's) and where it is defined (bases, decorators, defaults,
    a class's attributes; not annotations, which the modeling file leaves unevaluated)."""
    functions, defined = [obj], [node]
    if inspect.isclass(obj):
        functions = [getattr(m, "__func__", m) for k, m in vars(obj).items() if k not in left_out]
        defined += [m for m in node.body if getattr(m, "name", None) not in left_out]
    # a decorated method's own code, not its decorator's (torch.no_grad)
    codes = [inspect.unwrap(f).__code__ for f in functions if inspect.isfunction(f)]
    names = []
    while codes:
        code = codes.pop()
        names += [i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"]
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    for part in defined:
        if isinstance(part, (ast.FunctionDef, ast.ClassDef)):
            parts = part.decorator_list + getattr(part, "bases", [])
            if isinstance(part, ast.FunctionDef):
                parts += part.args.defaults + [d for d in part.args.kw_defaults if d is not None]
        else:
            parts = [part]  # a class attribute
        names += [n.id for p in parts for n in ast.walk(p)
                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return names


def modeling_source(module):
    """The folder's modeling file: the template (TEMPLATE) with its import of train_gpt2 replaced
    by what it imports from `module` (train_gpt2 as loaded) and everything of the module's that
    those use, in turn: its functions and classes as their source (GPT without LEFT_OUT's
    methods), its constants as values, the modules it imports as imports."""
    with open(TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    line = MODEL_CODE_IMPORT.search(template)
    lines = inspect.getsource(module).splitlines(keepends=True)
    nodes = {node.name: node for node in ast.parse("".join(lines)).body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    todo = [name.strip() for name in line.group(1).split(",")]
    imports, constants, definitions, seen = set(), {}, {}, set()
    while todo:
        name = todo.pop()
        if name in seen or (name not in vars(module) and hasattr(builtins, name)):
            continue
        seen.add(name)
        value = vars(module)[name]
        if inspect.ismodule(value):
            alias = ""
            if value.__name__ != name:
                alias = f" as {name}"
            imports.add(f"import {value.__name__}{alias}")
        elif getattr(value, "__module__", None) == module.__name__:
            left_out = LEFT_OUT.get(name, ())
            definitions[_first_line(nodes[name])] = _definition(nodes[name], lines, left_out)
            todo += _globals_read(value, nodes[name], left_out)
        elif inspect.isfunction(value) or inspect.isclass(value):
            raise ValueError(f"the model code uses {name}, which is not train_gpt2's own")
        else:  # a constant: its value, written as a literal
            try:
                literal = ast.literal_eval(repr(value)) == value
            except (ValueError, SyntaxError):
                literal = False
            if not literal:
                raise ValueError(f"the model code's constant {name} has no literal: {value!r}")
            constants[name] = f"{name} = {value!r}"
    order = list(vars(module))
    imports = sorted(i for i in imports if i not in template.splitlines())
    code = ("\n".join(imports) + "\n\n" + "".join(constants[k] + "\n" for k in sorted(
        constants, key=order.index)) + "\n\n" + "\n\n".join(definitions[k] for k in
                                                           sorted(definitions)))
    return template[: line.start()] + code.lstrip("\n") + template[line.end():]


def export_custom(model, out_dir, bos, eos, record=None):
    """A model folder that transformers loads with the model's own code: modeling_source in
    CUSTOM_FILE, config.json (GPTConfig's fields, with the classes to load: auto_map, and
    record's keys: the run's flags under RUN_KEY), the weights as they are (fp32, the vocab still
    padded: a checkpoint's, bit for bit; the padding ids are never predicted, and the logits leave
    them out) and generation_config.json."""
    import dataclasses

    import transformers
    from safetensors.torch import save_file

    c = model.config
    with open(os.path.join(out_dir, CUSTOM_FILE), "w", encoding="utf-8") as f:
        f.write(modeling_source(inspect.getmodule(type(model))))
    module = CUSTOM_FILE[: -len(".py")]
    config = {"architectures": [CUSTOM_CLASSES["AutoModelForCausalLM"]],
              "auto_map": {auto: f"{module}.{cls}" for auto, cls in CUSTOM_CLASSES.items()},
              "model_type": CUSTOM_TYPE, **dataclasses.asdict(c),
              "tie_word_embeddings": c.tie_embeddings, "bos_token_id": bos, "eos_token_id": eos,
              "use_cache": False, "transformers_version": transformers.__version__,
              **(record or {})}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos,
                                  use_cache=False).save_pretrained(out_dir)
    sd = {CUSTOM_PREFIX + k: v.detach().float().cpu().contiguous()
          for k, v in model.state_dict().items()}
    if c.tie_embeddings:  # one tensor, saved once: as the input embedding (transformers' way)
        del sd[CUSTOM_PREFIX + "lm_head.weight"]
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def folder_config(path):
    """The config.json of a model folder as a dict, or None where there is none to read."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def custom_config(path):
    """The config.json of a folder that export_custom wrote, or None for anything else."""
    config = folder_config(path)
    if config is None or config.get("model_type") != CUSTOM_TYPE:
        return None
    return config


def run_record(path):
    """The flags of the run that trained the model of a folder that export wrote (RUN_KEY); {}
    for a folder without them (OpenAI's GPT-2, an export from before the record)."""
    record = (folder_config(path) or {}).get(RUN_KEY)
    return record if isinstance(record, dict) else {}


def custom_state_dict(path, weights=True):
    """(GPTConfig keywords but dropout, state dict in fp32, or None without weights) of a folder
    that export_custom wrote (or that transformers saved again: its own keys left out, the
    weights maybe in shards or another dtype), read without running its code; a one-line
    UsageError if the weights cannot be read."""
    from safetensors.torch import load_file
    from transformers import PretrainedConfig

    config = custom_config(path)
    theirs = {*CUSTOM_KEYS, *PretrainedConfig().to_dict(), "dropout"}
    keywords = {k: v for k, v in config.items() if k not in theirs}
    if not weights:
        return keywords, None
    files = ["model.safetensors"]
    try:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        sd = {}
        for name in files:
            sd.update(load_file(os.path.join(path, name)))
    except Exception as e:  # missing, damaged or not safetensors
        raise UsageError(f"could not read the weights of {path} ({one_line(e, 200)})") from None
    sd = {k.removeprefix(CUSTOM_PREFIX): v.float() for k, v in sd.items()}
    if keywords.get("tie_embeddings") and "transformer.wte.weight" in sd:  # saved once
        sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])
    return keywords, sd
