"""Names and numbers of the overlay format, each defined once (imports nothing).

See docs/overlay-format.md for the contract these constants spell out.
"""

QUANT_METHOD = "embedq"          # quantization_config.quant_method
FORMAT_VERSION = 2               # quantization_config.format_version (what embedq writes)
# Versions every reader accepts: 1 recorded sha256 checksums, 2 records BLAKE3
# (embedq.format.digest); the tensors themselves are the same.
READABLE_FORMAT_VERSIONS = (1, 2)
OVERLAY_FORMAT = "embedq"        # __metadata__.format of embedq.safetensors

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
OVERLAY_NAME = "embedq.safetensors"
QCONFIG_NAME = "quantization_config.json"
STATE_DIR = ".embedq"            # backups and the lock of an in-place overlay
LOCK_FILE = "lock"               # in STATE_DIR: the folder lock (jobs/state.folder_lock), see lock_text

# Last name component of an output-embedding (head) module across architectures.
HEAD_NAMES = ("lm_head", "embed_out", "output")
# Last name component of an input-embedding (or MTP/draft embedding) module: the only
# modules an overlay may replace besides the heads above.
EMBED_NAMES = ("embed_tokens", "wte", "embed_in", "word_embeddings", "tok_embeddings",
               "embeddings", "embed", "shared", "token_embedding", "tok_emb", "tokens_embed",
               "word_embedding", "entity_embeddings", "w", "proj")
# Last name component of every output embedding transformers' models use (their saved and
# module spellings, e.g. BERT's cls.predictions.decoder, XLNet's lm_loss, Whisper's proj_out).
OUTPUT_NAMES = HEAD_NAMES + ("decoder", "cls", "head", "lm_loss", "out_proj", "proj", "proj_out",
                             "output_projection", "vocab_projector", "generator_lm_head")
# Tensors of one quantized module in the overlay: "<module>.<suffix>".
OVERLAY_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")

SUPPORTED_BITS = (4, 8)
# rtn: round-to-nearest; mse: error-minimizing scales; gptq: head-aware, calibrated.
METHODS = ("rtn", "mse", "gptq")
# per_layer: a per-layer input embedding beside the input embedding (Gemma 3n's
# embed_tokens_per_layer: vocabulary x (layers x 256), gathered once per token, never a head).
ROLES = ("embedding", "head", "mtp", "per_layer")
PER_LAYER_NAMES = ("embed_tokens_per_layer",)

# Bits per element of every dtype name a safetensors header may hold (safetensors 0.6+).
ST_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
                 "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
                 "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

# Safetensors dtype names <-> the config's dtype names (float tables and scales).
ST_FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def lock_text(pid: int, verb: str) -> str:
    """The text of LOCK_FILE while process ``pid`` runs ``embedq VERB`` (emptied on release)."""
    return f"pid {pid}, embedq {verb}\n"


def lock_pid(text: str) -> int | None:
    """The pid a :func:`lock_text` names; None for any other text (an emptied or foreign file)."""
    head, sep, _ = text.strip().partition(", embedq ")
    word, _, num = head.partition(" ")
    if not sep or word != "pid" or not (num.isascii() and num.isdigit()) or int(num) <= 0:
        return None  # pid 0 or below would make os.kill(pid, 0) probe a process group
    return int(num)


def is_embedding_name(module: str) -> bool:
    """Whether ``module`` names an input (or MTP/draft) embedding (``model.embed_tokens`` ...)."""
    return module.split(".")[-1] in EMBED_NAMES


def may_replace(module: str, role: str) -> bool:
    """Whether an overlay module of ``role`` may be named ``module``: an input embedding or an
    output head by its name, never a module inside a numbered layer (MTP/draft tables,
    role ``mtp``, may be: DeepSeek keeps them in ``model.layers.<n>``); a ``per_layer`` table
    only by a per-layer embedding's name."""
    parts = module.split(".")
    if role != "mtp" and any(p.isdigit() for p in parts):
        return False
    if role == "per_layer":
        return parts[-1] in PER_LAYER_NAMES
    return parts[-1] in (OUTPUT_NAMES if role == "head" else EMBED_NAMES)


def is_head_name(module: str) -> bool:
    """Whether ``module`` names an output embedding (``model.lm_head`` ...)."""
    return module.split(".")[-1] in HEAD_NAMES
