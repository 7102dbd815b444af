"""`--remat layer`: the decoder layers under one `lax.scan`, each layer recomputed in the backward pass
(and `--scan-layers`: their repeating period as a scan's body, without remat; `scan_periods`).

Why a scan and not `nnx.remat` around each layer of Tunix's Python loop (Tunix's
`RematConfig.DECODER`): that marks each layer's recomputation with optimization barriers,
and XLA's CPU pipeline expands those barriers early and then common-subexpression
elimination merges the recomputation back into the forward pass, so every layer's
activations stay live (the optimized HLO computes the "recomputed" values in the forward
pass; the CPU plan's temp bytes were equal with and without it). In a scan the backward
pass is a loop whose body recomputes one layer from that layer's saved input: nothing can
merge it with the forward loop, so the plan holds one layer's activations plus one [B, L, D]
input per layer, on every backend.

How, without forking Tunix: `scannable(model)` switches the model's class (before qwix adds
LoRA, so qwix's interception wraps this `__call__` and every einsum inside the scan is still
LoRA's) to a subclass whose `__call__` is Tunix's own unless `layer_scan` is on. When on, it
does what Tunix's does (embed, layers, final norm, sown hidden states, logits) with the
layer loop replaced by `scan_layers`: each layer is split into graph and state, the states
(one structure for every layer) are stacked leaf by leaf, and the scan merges each layer's
graph kind with its slice and calls the layer as Tunix wrote it. Gemma3's local and global
layers differ only in static fields (attention type, RoPE base), so each step picks its
kind's graph with `lax.switch` on a per-layer index. What differs between families (the
embedding, the layers' extra arguments, the logits, the layer kinds) is the family's
(train/families/). Tunix's Llama3 forward takes no `output_hidden_states`: the subclass adds
that argument and, when it is asked without the scan, runs Tunix's layer loop itself.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from train import families


def _kind(layer: nnx.Module) -> Any:
    """What makes two layers' graphs differ beyond their weights (Gemma3: local or global)."""
    return families.of(layer).layer_kind(layer)


def _stacked(layers: Sequence[nnx.Module], fix: str) -> tuple[list[Any], Any, list[jax.Array]]:
    """Each layer's graph, their one state structure, and their states stacked leaf by leaf."""
    graphs, treedefs, leaves = [], set(), []
    for layer in layers:
        graph, state = nnx.split(layer)
        flat, treedef = jax.tree.flatten(state)
        graphs.append(graph)
        treedefs.add(treedef)
        leaves.append(flat)
    if len(treedefs) != 1:
        raise ValueError(f"the decoder layers do not share one state structure; {fix}")
    return graphs, treedefs.pop(), [jnp.stack(column) for column in zip(*leaves)]


def scan_layers(layers: Sequence[nnx.Module], x: jax.Array, *args: Any, remat: bool = True, **kwargs: Any) -> jax.Array:
    """x through every layer, as `layer(x, *args, **kwargs)[1]` in order; with remat each layer is
    recomputed in the backward pass, without it the layers' repeating period is the loop's body."""
    if not remat:
        return scan_periods(layers, x, *args, **kwargs)
    split, treedef, stacked = _stacked(layers, "use --remat none")
    graphs, kinds = {}, []
    for layer, graph in zip(layers, split):
        kinds.append(list(graphs).index(_kind(layer)) if _kind(layer) in graphs else len(graphs))
        graphs.setdefault(_kind(layer), graph)

    def run(graph: Any, flat: list[jax.Array], h: jax.Array) -> jax.Array:
        layer = nnx.merge(graph, jax.tree.unflatten(treedef, flat))
        return layer(h, *args, **kwargs)[1]

    branches = [functools.partial(run, graph) for graph in graphs.values()]

    @jax.checkpoint  # save only each layer's input (the carry); recompute the rest in the backward pass
    def step(h: jax.Array, xs: tuple[jax.Array, list[jax.Array]]) -> tuple[jax.Array, None]:
        kind, flat = xs
        out = branches[0](flat, h) if len(branches) == 1 else jax.lax.switch(kind, branches, flat, h)
        return out.astype(h.dtype), None

    x, _ = jax.lax.scan(step, x, (jnp.asarray(kinds, jnp.int32), stacked))
    return x


def period(kinds: Sequence[Any]) -> int:
    """The shortest p with kinds[i] == kinds[i % p] for every i (Gemma3: 5 local layers and 1 global, 6)."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def scan_periods(layers: Sequence[nnx.Module], x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    """`--scan-layers` without remat: the layers' repeating period (one layer for Qwen3, Gemma3's 5 local
    and 1 global) is the body of one lax.scan, unrolled inside it, and a shorter tail (Gemma3 1B's 26
    layers: 4 periods and 2 layers) runs after it. Why periods and not scan_layers' lax.switch: without
    a checkpoint, the backward pass of a switch keeps every branch's residuals, zeros for the branch
    not taken; a body of fixed kinds keeps only its own. XLA compiles one period instead of every layer:
    a smaller executable, which compiles and loads from the cache faster (docs/benchmarks.md)."""
    p = period([_kind(layer) for layer in layers])
    repeats = len(layers) // p
    if repeats < 2:
        for layer in layers:
            x = layer(x, *args, **kwargs)[1].astype(x.dtype)
        return x
    graphs, treedefs, stacked = [], [], []
    for j in range(p):  # the period's j-th layer of every repeat, stacked
        split, treedef, leaves = _stacked(layers[j:repeats * p:p], "drop --scan-layers")
        graphs.append(split[0])
        treedefs.append(treedef)
        stacked.append(leaves)

    def body(h: jax.Array, period_leaves: list[list[jax.Array]]) -> tuple[jax.Array, None]:
        for graph, treedef, flat in zip(graphs, treedefs, period_leaves):
            layer = nnx.merge(graph, jax.tree.unflatten(treedef, flat))
            h = layer(h, *args, **kwargs)[1].astype(h.dtype)
        return h, None

    x, _ = jax.lax.scan(body, x, stacked)
    for layer in layers[repeats * p:]:
        x = layer(x, *args, **kwargs)[1].astype(x.dtype)
    return x


@functools.cache
def _scannable_class(base: type) -> type:
    family = families.of(base)
    signature = inspect.signature(base.__call__)

    def __call__(self, *args, **kwargs):
        hidden = None  # Tunix's forward takes output_hidden_states itself
        if not family.sows_hidden_states:  # ours takes it as Tunix's 5th argument and hands Tunix the rest
            args = list(args)
            hidden = bool(args.pop(4) if len(args) > 4 else kwargs.pop("output_hidden_states", False))
        if not self.layer_scan and not hidden:
            return base.__call__(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        # Tunix's names: Gemma3 (last_tokens, ..., images=), Qwen3 (input_tokens, ..., segment_ids=).
        _, tokens, positions, cache, attention_mask, *rest = bound.args
        output_hidden_states = rest[0] if hidden is None else hidden
        named = bound.arguments
        if cache is not None or named.get("images") is not None:  # decoding, or images: Tunix's loop
            return base.__call__(self, *args, **kwargs)
        # Tunix's forward (0.1.7), with its layer loop replaced by scan_layers (or, asked only for the
        # hidden states of a family whose forward cannot sow them, Tunix's loop).
        x = family.embed(self, tokens)
        layer_kwargs = family.layer_kwargs(named)
        if self.layer_scan:
            x = scan_layers(self.layers, x, positions, None, attention_mask, remat=self.layer_scan_remat, **layer_kwargs)
        else:
            for layer in self.layers:
                x = layer(x, positions, None, attention_mask, **layer_kwargs)[1]
        x = self.final_norm(x)
        if output_hidden_states:
            with warnings.catch_warnings():
                # Tunix 0.1.7 sows its hidden states the same way (train/step/chunked_loss.py pops them); flax
                # 0.12 deprecates sow outside nnx.capture, a warning Tunix's own call raises under its name.
                warnings.simplefilter("ignore", DeprecationWarning)
                self.sow(nnx.Intermediate, "all_hidden_states", x)
        return family.logits(self, x), None

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": __name__})


def scannable(model: nnx.Module) -> nnx.Module:
    """Gives the (base, pre-LoRA) model the `layer_scan` switch, off: Tunix's own forward until set_scan."""
    model.__class__ = _scannable_class(type(model))
    model.layer_scan = False
    model.layer_scan_remat = True
    return model


def set_scan(model: nnx.Module, on: bool, remat: bool = True) -> None:
    """The layers under one scan (on) or Tunix's loop; with remat (`--remat layer`) or without (`--scan-layers`)."""
    if not hasattr(model, "layer_scan"):
        raise ValueError("the model was built without the layer-scan switch (train.step.layer_scan.scannable before LoRA)")
    model.layer_scan = on
    model.layer_scan_remat = remat


def scan_is_on(model: nnx.Module) -> bool:
    return bool(getattr(model, "layer_scan", False))


def remat_is_on(model: nnx.Module) -> bool:
    return scan_is_on(model) and bool(getattr(model, "layer_scan_remat", True))
