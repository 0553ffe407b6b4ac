"""The model-kind registry: one entry per ``model.kind``, all that the rest of fbtrain needs
to know about a kind (as litgpt's name registry and torchtitan's ModelSpec do).

Read by config (the allowed kinds and their help text, which keys apply), the memory
budget (parameter and activation estimates, the carried memory), ``build_model`` (the
class), sampling (the key/value sets its state holds) and the trainer (whether there is
a memory mix to log). A new kind is its module under ``fbtrain/models/`` and one entry in
:data:`KINDS`; nothing else names kinds.

The class is named by its import path, resolved by :func:`fbtrain.models.build_model`:
config is the layer below the models (they import ModelConfig from it), so the registry
cannot import them. It sits below the schema too (which takes the kinds and their help
from it), so it reads a model config through :class:`ModelShape`, the fields it uses,
which ``ModelConfig`` has. tests/test_models.py checks every entry against the model it
names (its class, parameter count, memory mix, key/value sets and carried sources).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from fbtrain.errors import ArgumentError


class ModelShape(Protocol):
    """The fields of ``model:`` (config.schema.ModelConfig) that the registry reads."""

    kind: str
    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    max_rel_pos: int
    memory_norm: str

    @property
    def memory_window(self) -> int: ...


@dataclass(frozen=True)
class ModelKind:
    """What fbtrain knows about one model kind."""

    name: str  # the value of model.kind
    help: str  # its words in model.kind's help text ('' for none)
    model_class: str  # "module:Class", built as Class(ModelConfig, vocab_size)
    shared_kv: bool  # one key/value projection of memory for all layers (else one a layer)
    memory_mix: bool  # memory is the learned mix softmax(w) (model.memory_init applies)
    # Its step loop runs in float32 even under autocast (the feedback core), so its
    # activations cost 4 bytes a float whatever run.precision says.
    fp32_activations: bool
    # Vectors kept per carried memory slot, re-projected with the current weights when
    # carried (MemoryState.sources): m_t alone (1), or every layer's input (n_layers).
    carried_sources: Callable[[ModelShape], int]
    # Trainable parameters but the embedding and the output head (vocabulary-sized).
    parameters: Callable[[ModelShape], int]
    # Floats one micro-batch of (batch, seq_len) keeps for its backward on `carried`
    # slots of memory from the previous segment: a lower bound (config/budget.py).
    activations: Callable[[ModelShape, int, int, int], int]
    # Floats a no-gradient pass over a prompt holds at its peak, for (samples, prompt
    # tokens, vocabulary size): sampling's memory check (sample.py), which
    # scripts/sample_memory.py holds against the real peak (docs/performance.md).
    prompt_pass: Callable[[ModelShape, int, int, int], int]

    def key_value_sets(self, cfg: ModelShape) -> int:
        """Key/value sets of the memory state ([n_sets, B*H, slots, d_k])."""
        return 1 if self.shared_kv else cfg.n_layers


# ----------------------------------------------------------------------------- estimates


def _layers(cfg: ModelShape, own_kv: bool) -> int:
    """Parameters of the layer stack and the final LayerNorm (layers.py): per layer query
    D*D, u D, r rows*D, b rows*H, out D*D + D, two LayerNorms 4D, ff1 D*F + F, ff2 F*D + D,
    and with ``own_kv`` its key D*D and value D*D + D."""
    d, h, f, rows = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.max_rel_pos
    layer = 2 * d * d + 7 * d + rows * (d + h) + 2 * d * f + f
    own = 2 * d * d + d if own_kv else 0
    return cfg.n_layers * (layer + own) + 2 * d


def _feedback_parameters(cfg: ModelShape) -> int:
    return _layers(cfg, own_kv=True) + cfg.n_layers + 1  # + the memory-mix logits w


def _feedback_kv_parameters(cfg: ModelShape) -> int:
    d = cfg.d_model
    shared = 2 * d * d + (2 * d if cfg.memory_norm == "layernorm" else 0)  # key, value, norm
    return _layers(cfg, own_kv=False) + shared + cfg.n_layers + 1


def _transformer_parameters(cfg: ModelShape) -> int:
    return _layers(cfg, own_kv=True)


def sum_window(carried: int, steps: int, window: int) -> int:
    """``sum(min(carried + t, window) for t in range(steps))``, in closed form (steps may be
    far too many to loop over)."""
    # Steps t < window - carried see carried + t slots; the rest see the full window.
    growing = max(0, min(steps, window - carried))
    full = steps - growing
    return growing * carried + growing * (growing - 1) // 2 + full * window


def _feedback_activations(cfg: ModelShape, batch: int, seq_len: int, carried: int) -> int:
    """The feedback core (models/core/native.py / python.py): every layer's output at every
    step, the memory keys/values of all slots, and per layer and step the tape (a, q, o, y,
    LN2(y): 5 D; the FF hidden: F; the attention weights over the step's window: H *
    window). The backward keeps about as much again in activation gradients: not counted."""
    d, h, f, layers = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layers
    slots = carried + seq_len
    # Sum over the steps of the window each step attends to: min(carried + t, window).
    seen = sum_window(carried, seq_len, cfg.memory_window)
    key_sets = KINDS[cfg.kind].key_value_sets(cfg)
    per_row = (seq_len * (layers + 2) * d  # every layer's output and m_t, at every step
               + 2 * key_sets * slots * d  # memory keys and values
               + layers * (seq_len * (5 * d + f) + h * seen))  # the tape
    return batch * per_row


def _transformer_activations(cfg: ModelShape, batch: int, seq_len: int, carried: int) -> int:
    """transformer.py: per layer and position about eight D-sized tensors (the input, its
    LayerNorm, the query by row and by head, the attention output, y, LN2(y) and more) and
    the F-sized hidden, keys and values of all ``carried + seq_len`` slots, and the
    attention probabilities over the slots each position sees (its row block reads at
    least those)."""
    d, h, f = cfg.d_model, cfg.n_heads, cfg.d_ff
    slots = carried + seq_len
    seen = sum_window(carried, seq_len, cfg.memory_window)
    per_layer = seq_len * (8 * d + f) + h * seen + 2 * slots * d
    return batch * cfg.n_layers * per_layer


def _feedback_prompt_pass(cfg: ModelShape, samples: int, prompt: int, vocab: int) -> int:
    """feedback.py without gradients: per prompt position the embedding, every layer's
    output and m_t (the core's outputs), the memory keys and values of every slot, the
    final LayerNorm's output and the logits. The core attends a step's window at a time
    and keeps no tape, so nothing grows with the square of the prompt."""
    d, key_sets = cfg.d_model, KINDS[cfg.kind].key_value_sets(cfg)
    return samples * prompt * (vocab + (cfg.n_layers + 4 + 2 * key_sets) * d)


def _transformer_prompt_pass(cfg: ModelShape, samples: int, prompt: int, vocab: int) -> int:
    """transformer.py without gradients: per prompt position the embedding, each layer's
    input, keys and values, and each a second time (stacked: the inputs for the state's
    sources, the keys and values as the state), the feed-forward hidden, the final
    LayerNorm's output and the logits. Its attention runs a block of query rows at a time
    over the slots they see (transformer.attend), so nothing grows with the square of the
    prompt."""
    d, layers = cfg.d_model, cfg.n_layers
    return samples * prompt * (vocab + (6 * layers + 2) * d + cfg.d_ff)


# ----------------------------------------------------------------------------- the registry


def _one(cfg: ModelShape) -> int:
    return 1


def _every_layer(cfg: ModelShape) -> int:
    return cfg.n_layers


_FEEDBACK = "fbtrain.models.feedback:FeedbackTransformer"
KINDS: dict[str, ModelKind] = {kind.name: kind for kind in (
    ModelKind("feedback", "per-layer key/value", _FEEDBACK, shared_kv=False, memory_mix=True,
              fp32_activations=True, carried_sources=_one, parameters=_feedback_parameters,
              activations=_feedback_activations, prompt_pass=_feedback_prompt_pass),
    ModelKind("feedback_kv", "shared key/value", _FEEDBACK, shared_kv=True, memory_mix=True,
              fp32_activations=True, carried_sources=_one, parameters=_feedback_kv_parameters,
              activations=_feedback_activations, prompt_pass=_feedback_prompt_pass),
    ModelKind("transformer", "", "fbtrain.models.transformer:Transformer", shared_kv=False,
              memory_mix=False, fp32_activations=False, carried_sources=_every_layer,
              parameters=_transformer_parameters, activations=_transformer_activations,
              prompt_pass=_transformer_prompt_pass),
)}


def find_kind(name: object) -> ModelKind | None:
    """The registry's entry for ``name``; None for any other value, of any type."""
    return KINDS.get(name) if isinstance(name, str) else None


def model_kind(name: object) -> ModelKind:
    """The registry's entry for ``name``; ArgumentError (one line, the kinds named) for
    any other value, wherever it came from (a checkpoint's raw dict included: its ``null``
    or list, which the config's field checks pass over as the wrong type, too)."""
    kind = find_kind(name)
    if kind is None:
        raise ArgumentError(f"model.kind = {name!r}: must be one of {', '.join(KINDS)}")
    return kind


def kinds_help(kinds: Iterable[ModelKind] = KINDS.values()) -> str:
    """model.kind's help text: each kind with its words, "a (x), b (y) or c."."""
    *others, last = [f"{k.name} ({k.help})" if k.help else k.name for k in kinds]
    return f"{', '.join(others)} or {last}." if others else f"{last}."
