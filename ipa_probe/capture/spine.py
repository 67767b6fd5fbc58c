"""The attachment core: one per denoiser, shared by every ipa_probe feature attached to it.

The probe, its maps, ``intervene`` (ablate, swap, scale), the hook points (hooks, cache, patch) and the NW head are
*clients* of one :class:`Spine`. The spine owns

- the denoiser's **one** forward pre-hook and **one** forward hook, however many features are attached: each pass
  it places the call in the denoising loop once and then calls its clients in the order they attached;
- the **step clock**: which pipeline call (:class:`~.clock.CallClock`), which denoising step and which pass of the
  step (the family's :meth:`~.taps.Tap.begin_pass`), and the pass's timestep, as :class:`PassInfo`;
- the **per-layer hooks** (:class:`LayerHooks`): one forward pre-hook and one forward hook on each module of the
  IP-Adapter layers that some client reads or edits (the query, the branches' key and value projections, where a
  branch's output is added, the attention), calling the clients' callbacks in one order (edits, then readers), and
  what the layer computed there kept once for all of them;
- the **mask normalisation** (:func:`normalise_masks`): diffusers' ``ip_adapter_masks`` in one form;
- the **meeting point of reading and editing** in each IP-Adapter layer's image branch: an edit that removes
  references from the keys says which ones stay (:meth:`Spine.keep_references`), an edit of the weights or the
  contributions publishes what the layer then used (:meth:`Spine.use`), and every reader (the probe, its maps) reads
  those, so a feature inside another measures what the layer computed, not what it would have computed without the
  edit.

The spine is created by the first client and taken off the denoiser with the last (:func:`attach`,
:func:`detach`): with nothing attached, the denoiser carries no trace of it. Nothing here synchronises with the
device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from .._checks import step_selected
from ..layers import IPLayer, denoiser_of, find_ip_layers, keep, kept, observer
from .branches import PromptEvidence, label_vocabulary
from .clock import CallClock
from .taps import tap_for
from .taps.base import DenoiserPass, Tap, heads_first, layer_module, normalise_masks

__all__ = ["EDIT", "READ", "LayerHooks", "PassInfo", "Spine", "attach", "detach", "expand_references", "kept_tokens"]
__all__ += ["normalise_masks", "spine_of"]

#: The order of the callbacks on one module (:meth:`LayerHooks.add`): edits (in the order added), what the layer
#: computed kept (:meth:`LayerHooks.keep`), readers; a layer's kept tensors are dropped first and last.
FIRST, EDIT, KEEP, READ, LAST = range(5)


def expand_references(x: torch.Tensor, kept: tuple[int, ...], total: int, dim: int, fill: float) -> torch.Tensor:
    """``x`` with the references an edit removed put back as ``fill`` along ``dim`` (reference-major tokens).

    ``x``'s axis ``dim`` holds ``len(kept) * T`` image tokens (``T`` per reference; ``kept``: the references present,
    in order); the result holds ``total * T`` (``total``: how many the call passed). ``fill``: ``-inf`` for logits
    (weight 0), ``0`` for values.
    """
    dim = dim % x.dim()
    tokens = x.shape[dim] // max(len(kept), 1)
    shape = list(x.shape)
    shape[dim] = total * tokens
    return x.new_full(shape, fill).index_copy(dim, kept_tokens(kept, tokens, x.device), x)


def kept_tokens(kept: tuple[int, ...], tokens: int, device: torch.device) -> torch.Tensor:
    """The token positions ``(len(kept) * T,)`` of the ``kept`` references among all (reference-major)."""
    return torch.tensor([r * tokens + t for r in kept for t in range(tokens)], dtype=torch.long, device=device)


def pass_masks(kwargs: dict) -> list[torch.Tensor | None] | None:
    """The normalised ``ip_adapter_masks`` of a denoiser call (UNet, Flux or SD3 keyword arguments)."""
    extra = kwargs.get("cross_attention_kwargs") or kwargs.get("joint_attention_kwargs") or {}
    return normalise_masks(extra.get("ip_adapter_masks"))


class LayerHooks:
    """The per-layer hooks of one denoiser (:attr:`Spine.hooks`), shared by every client: at most one forward
    pre-hook and one forward hook on a module, however many clients read or edit it, off with its last callback.

    Attributes:
        seen: ``(layer id, site, branch)`` -> what the layer computed at a site in its running call, for the clients
            that asked (:meth:`keep`): ``"q"`` heads first ``(B, H, Q, D)``, keys and values as their module returned
            them (after the edits there); clients keep what else they hold for the running call here too (the probe's
            records that wait for edited weights); dropped when the layer is called, when it returns and when a
            denoiser pass starts.
    """

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, int | str], Any] = {}
        self.compiled = False  # a callback ran in a compiled region (``compile_repeated_blocks()``: dynamo traced it)
        self._chains: dict[tuple[int, bool], tuple[list[tuple[int, Callable]], Any]] = {}

    def add(self, module: torch.nn.Module, fn: Callable, *, pre: bool = False, order: int = READ) -> Any:
        """Call ``fn`` at every forward of ``module``, after the callbacks of a lower ``order`` (:data:`EDIT`,
        :data:`READ`) and those added before: ``fn(module, args, kwargs)`` before the forward (``pre``), returning
        ``None`` or the ``(args, kwargs)`` it then gets, else ``fn(module, args, output)`` after it, returning ``None``
        or the output that replaces it (the next callbacks get what the last returned). Returns a handle whose
        ``remove()`` takes ``fn`` off (idempotent)."""
        key = (id(module), pre)
        if key not in self._chains:
            chain: list[tuple[int, Callable]] = []
            register, run = module.register_forward_pre_hook if pre else module.register_forward_hook, observer(_run)

            def hook(module, args, last):  # traced where the module sits in a compiled region: says so
                return run(self, chain, pre, module, args, last, torch.compiler.is_compiling())

            self._chains[key] = (chain, register(hook, with_kwargs=pre))
        chain = self._chains[key][0]
        chain.insert(sum(o <= order for o, _ in chain), (order, fn))
        return SimpleNamespace(remove=partial(self._remove, key, (order, fn)))

    def keep(self, layer: IPLayer, *sites: tuple[str, int | str]) -> list[Any]:
        """Keep what ``layer`` computes at each ``(site, branch)`` in :attr:`seen` while it runs; returns handles."""
        name = layer.name

        def forget(module, *_) -> None:
            for key in [key for key in self.seen if key[0] == name]:
                del self.seen[key]

        def store(site: str, branch: int | str, module, args, output) -> None:
            self.seen[(name, site, branch)] = heads_first(layer, output) if site == "q" else output

        attn = layer.attention
        kept = [self.add(layer_module(layer, *site), partial(store, *site), order=KEEP) for site in sites]
        return [self.add(attn, forget, pre=True, order=FIRST), *kept, self.add(attn, forget, order=LAST)]

    def _remove(self, key: tuple[int, bool], entry: tuple[int, Callable]) -> None:
        chain, handle = self._chains.get(key, ([], None))
        if entry in chain:
            chain.remove(entry)
            if not chain:
                handle.remove()
                del self._chains[key]

    def clear(self) -> None:  # every hook off, with what clients left when they raised on the way out
        for _, handle in self._chains.values():
            handle.remove()
        self._chains.clear()
        self.seen.clear()
        self.compiled = False


def _run(hooks: LayerHooks, chain: list[tuple[int, Callable]], pre: bool, module, args, last, compiled: bool):
    """A module's one hook: its callbacks in order, each given what the one before returned (``last``: the keyword
    arguments before the forward, ``pre``, or the output)."""
    hooks.compiled, changed = hooks.compiled or compiled, False
    for _, fn in list(chain):
        result = fn(module, args, last)
        if result is not None:
            (args, last), changed = (result if pre else (args, result)), True
    return None if not changed else (args, last) if pre else last


@dataclass
class PassInfo:
    """Where one denoiser pass sits in the loop (read by the clients in their ``on_pass``).

    Attributes:
        new_call, new_step: the pass starts a new pipeline call (:mod:`~.clock`), a new denoising step.
        call: the pipeline call's index since the spine was created.
        step: the denoising loop index (0 at a call's first pass).
        pass_index: the pass within its step (0 for the first; Flux's true-CFG negative pass is 1).
        timestep: the scheduler timestep as the denoiser got it (a tensor or a number, or ``None``).
        denoiser_pass: the family's reading of the pass (:class:`~.taps.base.DenoiserPass`: its guidance label,
            whether it is recorded).
        masks: the pass's normalised ``ip_adapter_masks`` (:func:`normalise_masks`).
        edits: the edits acting in this pass, in the order they act (each client that edits names itself here).
        compiled: the denoiser's own call is compiled (an in-place ``module.compile()``: dynamo traced the pre-hook).
    """

    new_call: bool = False
    new_step: bool = False
    call: int = -1
    step: int = -1
    pass_index: int = 0
    timestep: Any = None
    denoiser_pass: DenoiserPass = field(default_factory=lambda: DenoiserPass(new_step=True))
    masks: list[torch.Tensor | None] | None = None
    edits: list[str] = field(default_factory=list)
    compiled: bool = False


class Spine:
    """The attachment core of one denoiser (create it through :func:`attach`): hooks sit on ``denoiser``; ``pipe``
    (its call frames and scheduler tell the call boundaries) may be the denoiser itself."""

    def __init__(self, pipe, denoiser: torch.nn.Module) -> None:
        self.pipe = pipe
        self.denoiser = denoiser
        self.tap: Tap = tap_for(pipe, find_ip_layers(denoiser))  # the family's clock rules (not its taps)
        self.clock = CallClock(pipe)
        self.clients: list[Any] = []
        self.now = PassInfo()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        #: the per-layer hooks every client reads and edits through
        self.hooks = LayerHooks()
        #: (layer id, adapter) -> ``(kept, total)``: the references whose tokens the layer's image keys hold in this
        #: pass, in order, of the ``total`` the call passed, when an edit removed some (:meth:`keep_references`)
        self.kept: dict[tuple[str, int], tuple[tuple[int, ...], int]] = {}
        #: the same for the image values (edits of the keys and of the values run separately, in the same order)
        self.kept_values: dict[tuple[str, int], tuple[tuple[int, ...], int]] = {}
        #: (layer id, adapter, point) -> what the layer used at that hook point in this pass, when an edit changed it
        #: (:meth:`use`): ``"weights"`` ``(B, H, Q, K)``, ``"contribution"`` ``(B, R, Q, C)``
        self.used: dict[tuple[str, int, str], torch.Tensor] = {}
        #: (layer id, adapter) pairs whose image branch an attached client will edit in this pass (set in ``on_pass``)
        self.weight_edits: set[tuple[str, int]] = set()
        #: the prompt embeddings seen, when a client asked for branch labels (:meth:`watch_prompts`), and how many ask
        self.evidence: PromptEvidence | None = None
        self._watchers = 0
        #: the hook points' hooks (:mod:`ipa_probe.intervention.points`), while a client holds points
        self.points: Any = None

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        on_call = observer(self._on_call)

        def pre_hook(module, args, kwargs) -> None:  # traced where the denoiser is compiled in place: says so
            return on_call(module, args, kwargs, torch.compiler.is_compiling())

        self._handles.append(self.denoiser.register_forward_pre_hook(pre_hook, with_kwargs=True))
        self._handles.append(self.denoiser.register_forward_hook(observer(self._on_return)))

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.hooks.clear()
        self.clock.reset()
        self.tap.reset()
        self._watchers = 1
        self.watch_prompts(False)
        self.kept.clear()
        self.kept_values.clear()
        self.used.clear()
        self.now = PassInfo()

    # ------------------------------------------------------------------ the clock
    def _on_call(self, module, args, kwargs, compiled: bool = False) -> None:
        now, tap = self.now, self.tap
        new_call = self.clock.new_call(tap.argument("timestep", args, kwargs))  # the denoiser's own input
        tap.running = self.clock.running
        if new_call:
            tap.begin_call(args, kwargs)
        denoiser_pass = tap.begin_pass(args, kwargs)
        step = -1 if new_call else now.step
        new_step = denoiser_pass.new_step or step < 0
        self.now = PassInfo(
            new_call=new_call,
            new_step=new_step,
            call=now.call + new_call,
            step=step + new_step,
            pass_index=0 if new_step else now.pass_index + 1,
            timestep=tap.timestep(args, kwargs),
            denoiser_pass=denoiser_pass,
            masks=pass_masks(kwargs),
            compiled=compiled,
        )
        self.kept.clear()
        self.kept_values.clear()
        self.used.clear()
        self.hooks.seen.clear()
        self.weight_edits = set()
        if self.evidence is not None:
            self.evidence.pass_seen()
        for client in list(self.clients):
            hook = getattr(client, "on_pass", None)
            if hook is not None:
                hook(self, args, kwargs)

    def _on_return(self, module, args, output) -> None:
        for client in list(self.clients):
            hook = getattr(client, "on_return", None)
            if hook is not None:
                hook(self, output)

    @property
    def running(self):
        """The pipeline whose call is running (the probed one, or a ``from_pipe`` sibling sharing the denoiser)."""
        return self.clock.running

    def watch_prompts(self, on: bool = True) -> None:
        """Keep the prompt embeddings the pipeline computes from now on (:class:`~.branches.PromptEvidence`), for
        :meth:`branch_labels`, or stop (``on=False``): a client calls this when it attaches, before the pipeline
        encodes its prompts, and again when it leaves; the encoders' wrappers come off when the last client that asked
        leaves (nested blocks leave in the reverse order, so they come off in the order they went on)."""
        self._watchers = max(self._watchers + (1 if on else -1), 0)
        if self._watchers and self.evidence is None:
            self.evidence = PromptEvidence(self.pipe, label_vocabulary(None))
            self.evidence.install()
        elif not self._watchers and self.evidence is not None:
            evidence, self.evidence = self.evidence, None
            evidence.remove()

    def branch_labels(self, args: tuple, kwargs: dict) -> tuple[str, ...]:
        """Each batch item's branch label in this pass (``"cond"``, ``"uncond"``, ``"batch"`` when no evidence
        matched, ...), decided from the evidence as the probe's table decides it (:mod:`.branches`). Reads the labels
        back from the device (one synchronisation per pass)."""
        context = self.tap.argument("encoder_hidden_states", args, kwargs)
        device = self.tap.sample(args, kwargs).device
        self.evidence.running = self.running
        items = self.evidence.layout(context, device, self.now.denoiser_pass.label).items.tolist()
        return tuple(self.evidence.vocabulary[i] for i in items)

    def selects(self, client: Any, steps: Any, when: Callable | None, label: str, args: tuple, kwargs: dict) -> bool:
        """Whether ``client`` (an edit, a reader) acts in this pass: ``steps`` selects its step
        (:func:`~ipa_probe._checks.step_selected`) and ``when(spine, args, kwargs)`` (``None``: any) the pass. Counts
        the step in ``client.steps_run`` and a selected pass in ``client.selected``, and names the edit ``label``
        (when given) in :attr:`PassInfo.edits`."""
        now = self.now
        client.steps_run = max(client.steps_run, now.step + 1)
        if not step_selected(steps, now.step, now.timestep) or (when is not None and not when(self, args, kwargs)):
            return False
        client.selected += 1
        if label:
            now.edits.append(label)
        return True

    def planned_steps(self) -> int | None:
        """How many steps the running call's loop has, or ``None`` when unknown."""
        return self.clock.planned_steps()

    # ------------------------------------------------------------------ where reading and editing meet
    def keep_references(self, layer: str, adapter: int, kept: tuple[int, ...], total: int, keys: bool = True) -> None:
        """An edit removed references from ``layer``'s image keys (``keys``) or values in this pass: ``kept`` are
        those that stay, of ``total``, as the call indexed them."""
        (self.kept if keys else self.kept_values)[(layer, adapter)] = (tuple(kept), total)

    def kept_references(self, layer: str, adapter: int, keys: bool, images: int) -> tuple[tuple[int, ...], int]:
        """``(kept, total)``: the references ``layer``'s image keys (``keys``) or values hold so far in this pass, as
        the call indexed them; ``images`` tokens' references when no edit removed any. Edits applied one after
        another index the call's references through this, so that nested ones compose as if given at once."""
        return (self.kept if keys else self.kept_values).get((layer, adapter), (tuple(range(images)), images))

    def use(self, layer: str, adapter: int, point: str, value: torch.Tensor) -> None:
        """An edit reached ``point`` (``"weights"`` or ``"contribution"``): ``value`` is what ``layer``'s image branch
        used there (contributions all NaN where an edit of the output left the per-reference split undefined)."""
        self.used[(layer, adapter, point)] = value


def spine_of(pipe) -> Spine | None:
    """The spine attached to ``pipe``'s denoiser, or ``None``."""
    return kept(denoiser_of(pipe), "spine")


def attach(pipe, client: Any) -> Spine:
    """Add ``client`` to ``pipe``'s spine and return the spine (created, with its two denoiser hooks, for the first
    client).

    A client may define ``on_pass(spine, args, kwargs)`` (after the clock, in attach order, every denoiser pass) and
    ``on_return(spine, output)`` (when the pass returns; not when it raises).
    """
    denoiser = denoiser_of(pipe)
    spine = kept(denoiser, "spine")
    if spine is None:
        spine = Spine(pipe, denoiser)
        keep(denoiser, "spine", spine)
        try:
            spine.install()
        except BaseException:
            spine.uninstall()
            keep(denoiser, "spine", None)
            raise
    spine.clients.append(client)
    return spine


def detach(pipe, client: Any) -> None:
    """Take ``client`` off ``pipe``'s spine (and the spine off the denoiser with its last client); idempotent."""
    denoiser = denoiser_of(pipe)
    spine = kept(denoiser, "spine")
    if spine is None:
        return
    if client in spine.clients:
        spine.clients.remove(client)
    if not spine.clients:
        try:
            spine.uninstall()
        finally:
            keep(denoiser, "spine", None)


def client(on_pass: Callable | None = None, on_return: Callable | None = None) -> Any:
    """A client made of two functions (for features whose whole denoiser hook is one function)."""
    return _FunctionClient(on_pass, on_return)


@dataclass(eq=False)
class _FunctionClient:
    on_pass: Callable | None = None
    on_return: Callable | None = None
