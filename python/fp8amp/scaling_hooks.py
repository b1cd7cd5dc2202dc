"""The delayed-scaling update after each optimizer step: :func:`register_scaling_hooks` (what
``initialize`` and ``convert(..., optimizer)`` call) and :func:`update_scaling` (by hand).

- Each scaling state is updated by the hooks of one optimizer: the first registered for it that
  is still alive. A model stepped by several optimizers (say Muon for its matrices and AdamW for
  the rest) rolls each amax history once per step of that optimizer, not once per optimizer;
  when that optimizer is gone, the next registered one takes its states over. One registered
  later that holds all of its parameters replaces it (a new optimizer over the whole model after
  a phase that trained the head alone) and takes its states over at once; any other takes them
  over when that optimizer has not stepped between two of its steps (kept but no longer stepped;
  an optimizer per parameter stepped in backward whose parameter got no gradient).
- A model converted without an optimizer (``convert(model)``, ``initialize(model, None, ...)``)
  is watched until its scaling is registered: an optimizer that steps its parameters twice with
  no scaling update between warns once (:func:`watch_scaling_updates`), since nothing would ever
  update it (a Trainer's own optimizer, an ``fp8amp.optim.AdamW`` built by hand), and so is an
  Fp8Linear built by its constructor (``fp8amp.Fp8Linear(in, out)``) until a model holding it is
  registered, converted or found by a registered model's hooks. So is a
  registered model from a training step that none of its optimizers took until one steps (a new
  optimizer built by hand for a new phase, not registered), and the check is of the states of the
  layers the stepping optimizer holds (another model's update says nothing of them).
- A step skipped without ``optimizer.step()`` (GradScaler's skip) runs no update: the inf / NaN
  amaxes it recorded are dropped at fp8amp's optimizer's next ``zero_grad``
  (:func:`drop_skipped_amaxes`) and, for any optimizer, at the model's next training forward with
  its gradients cleared (:mod:`fp8amp.skipped_steps`), so that the next step's warm-up casts scale
  by their own amax.
- A copy of a registered optimizer (``copy.deepcopy``, ``pickle``, ``torch.save``) registers its
  models again: copied together with the optimizer (``copy.deepcopy((model, optimizer))``), the
  models are their copies, whose scales then follow the copy's steps. torch's own
  ``Optimizer.__getstate__`` keeps no hooks, which froze a copy's scales silently.
"""

from __future__ import annotations

import copyreg
import functools
import warnings
import weakref
from typing import Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .amax_sync import _end_step, _reduce_amaxes, _start_amax_reduction, delayed_states
from .linear import Fp8Linear, on_built
from .scaling import ScalingState, update_states
from .skipped_steps import drop_nonfinite_amaxes, mark_stepped, on_unstepped, watch_skipped_steps

__all__ = ["register_scaling_hooks", "update_scaling", "scales_after_step", "watch_scaling_updates"]

# Each state's registered optimizers (weak references, in registration order); the first alive
# updates it. Weak keys: a state that is gone leaves it; a deep copy of a model is not in it.
_REGISTERED: "weakref.WeakKeyDictionary[ScalingState, list[weakref.ref]]" = weakref.WeakKeyDictionary()
# Bumped when some state's owner may change (a registration, an optimizer gone): each optimizer's
# hooks sort out their own states again only then, not at every step.
_generation = 0


def _ownership_changed(_=None) -> None:
    global _generation
    _generation += 1


class _StepHooks:
    """One optimizer's step hooks: before the step, the start of the amax reduction
    (:func:`fp8amp.amax_sync.start_amax_reduction`); after it, :func:`update_scaling` of the
    states of its models that it owns."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = weakref.ref(optimizer, _ownership_changed)
        self.models: list[nn.Module] = []
        self.found: list[ScalingState] | None = None  # the pre-hook's states, for the post-hook
        self.walked: list[ScalingState] | None = None  # the models' states at the last sorting ...
        self.owned: list[ScalingState] = []  # ... and those of them this optimizer updates
        self.owners: list[weakref.ref] = []  # the optimizers that update the others
        self.owner_steps: dict[int, int] = {}  # their step counts at this one's previous step, by id
        self.steps = 0  # eager steps taken, which the optimizers registered after it read
        self.stepped = False  # a step since the optimizer's previous zero_grad (drop_skipped_amaxes)
        self.generation = -1

    def add(self, model: nn.Module) -> None:
        self.models.append(model)
        self.claim(delayed_states(model))
        watch_skipped_steps(model)

    def claim(self, states: list[ScalingState]) -> None:
        """Registers this optimizer for ``states`` (after those registered before it)."""
        me, added = self.optimizer, False
        for state in states:
            refs = _REGISTERED.get(state)
            if refs is None:
                _REGISTERED[state] = [me]
            elif not any(r is me for r in refs):
                refs.append(me)
            else:
                continue
            added = True
        if added:
            _ownership_changed()

    def states(self) -> list[ScalingState]:
        """The states to update this step. The module tree is walked once a step (host time in
        every step's hot loop); which states are this optimizer's is sorted out again only when
        the walk finds other states or an ownership changed (one list comparison otherwise)."""
        models = self.models
        walked = (delayed_states(models[0]) if len(models) == 1
                  else list({id(s): s for m in models for s in delayed_states(m)}.values()))
        if walked != self.walked or self.generation != _generation:
            self.claim(walked)  # states that appeared since the registration (layers converted later)
            owned, owners = [], {}
            for state in walked:
                refs = _REGISTERED[state]
                refs[:] = [r for r in refs if r() is not None]
                if refs[0] is self.optimizer:
                    owned.append(state)
                else:
                    owners[id(refs[0])] = refs[0]
            self.walked, self.owned, self.owners, self.generation = walked, owned, list(owners.values()), _generation
        return self.owned

    def take_over_idle(self) -> bool:
        """Takes over the states of each optimizer that updates them and has not stepped since this
        one's previous step: one kept but no longer stepped, or one stepped in backward (torchtune's
        optimizer per parameter) whose parameter got no gradient (unused, frozen), which left every
        history unrolled, silently. Returns whether it took any."""
        counts = {}
        for ref in self.owners:
            owner = ref()
            if owner is not None:  # (one gone hands its states on at the next sorting)
                counts[id(ref)] = owner.__dict__["_fp8amp_step_hooks"].steps
        idle = {key for key, steps in counts.items() if self.owner_steps.get(key) == steps}
        self.owner_steps = counts
        if not idle:
            return False
        for state in self.walked:
            refs = _REGISTERED[state]
            if id(refs[0]) in idle:
                refs.remove(self.optimizer)
                refs.insert(0, self.optimizer)
        _ownership_changed()
        return True

    def start(self, _, args, kwargs) -> None:  # a pre-hook returns None (or new arguments for step)
        states = self.found = self.states()
        # A closure (Lightning's every step) runs a forward and backward inside step(), after this
        # hook: a reduction issued now would copy back maxima taken before them, overwriting their
        # amaxes. Then the post-hook reduces, after the closure, without the overlap.
        if states and (args[1] if len(args) > 1 else kwargs.get("closure")) is None:  # args: (optimizer, closure?)
            _start_amax_reduction(states, step_bound=True)

    def finish(self, *_) -> None:  # not run when the step raises: its reduction is then discarded
        states, self.found = self.found, None
        self.stepped = True  # (set in traced steps too, where ``steps`` stays)
        for model in self.models:
            mark_stepped(model)
            if _WATCHED:  # (watched again after steps it did not take: skipped ones, say)
                _WATCHED.pop(model, None)
        if not torch.compiler.is_compiling():
            self.steps += 1
            if self.owners and self.take_over_idle():
                states = None
        states = self.states() if states is None else states
        if states:
            _end_step(states)
            _update_states(states)


def scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Whether :func:`register_scaling_hooks` registered ``model`` on ``optimizer``."""
    hooks = optimizer.__dict__.get("_fp8amp_step_hooks")
    return hooks is not None and any(m is model for m in hooks.models)


def register_scaling_hooks(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After each ``optimizer.step()``, :func:`update_scaling` of ``model``; before it, the start of
    the amax reduction across ranks, so that the collective overlaps the step
    (:func:`fp8amp.amax_sync.start_amax_reduction`), unless the step is given a closure, whose
    forward and backward record amaxes inside the step: then the reduction follows it.
    Each scaling state is updated once a step, since a second update would roll its amax history
    twice: registering a model again on the same optimizer (or a module inside one registered)
    changes nothing, and of several optimizers registered for the same states, the first one
    registered (and still alive) updates them, unless a later one holds all of its parameters
    (it replaces that one, which may still be held but no longer steps), or steps twice while
    that one does not (it takes the states over). A copy of ``optimizer``
    (``copy.deepcopy``, ``pickle``) registers the copy of ``model`` made with it
    (``copy.deepcopy((model, optimizer))``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"register_scaling_hooks: model must be an nn.Module, got {type(model).__name__}")
    check_hookable(optimizer, "register_scaling_hooks")
    hooks = optimizer.__dict__.get("_fp8amp_step_hooks")
    if hooks is None:
        hooks = optimizer.__dict__["_fp8amp_step_hooks"] = _StepHooks(optimizer)
        optimizer.register_step_pre_hook(hooks.start)
        optimizer.register_step_post_hook(hooks.finish)
        # On the instance (pickle and copy look __reduce_ex__ up there): the optimizer's class may
        # be torch's, whose state keeps no hooks. (A weak reference: no cycle keeps it alive.)
        optimizer.__dict__["__reduce_ex__"] = functools.partial(_reduce_registered, hooks.optimizer)
    if not any(m is model for m in hooks.models):
        hooks.add(model)
        _replace_superseded(hooks.optimizer, delayed_states(model))
    _unwatch_inside(model)


def check_hookable(optimizer: object, caller: str) -> None:
    """Refuses what is not a ``torch.optim.Optimizer``, and a wrapper whose step runs no hooks (one
    that did not run ``Optimizer.__init__``: Accelerate's AcceleratedOptimizer), naming what works."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        inner = getattr(optimizer, "optimizer", None)
        inner = " (optimizer.optimizer)" if isinstance(inner, torch.optim.Optimizer) else ""
        raise TypeError(f"{caller}: optimizer ({type(optimizer).__name__}) wraps another optimizer and runs "
                        "no step hooks of its own (it did not call torch.optim.Optimizer.__init__): pass the "
                        f"optimizer it wraps{inner}, or convert / initialize before wrapping it (before "
                        "accelerator.prepare)")


def _replace_superseded(me: weakref.ref, states: list[ScalingState]) -> None:
    """Puts the optimizer ``me`` before each optimizer registered earlier for ``states`` all of whose
    parameters it holds: one it replaces (a new optimizer over the whole model after a phase that
    trained the head alone), which, still held but no longer stepped, kept the states' scales frozen.
    Optimizers over parts of a model (Muon and AdamW, a GAN's two) keep their order."""
    held = {id(p) for group in me().param_groups for p in group["params"]}
    superseded: dict[int, bool] = {}
    for state in states:
        refs = _REGISTERED[state]
        mine = next(i for i, r in enumerate(refs) if r is me)
        for i, ref in enumerate(refs[:mine]):
            other = ref()
            if other is None:
                continue
            if id(other) not in superseded:
                superseded[id(other)] = all(id(p) in held for group in other.param_groups for p in group["params"])
            if superseded[id(other)]:
                refs.insert(i, refs.pop(mine))
                _ownership_changed()
                break


def registered_optimizers(model: Optional[nn.Module] = None) -> list[torch.optim.Optimizer]:
    """The live optimizers registered for any of ``model``'s scaling states (None: of any model's),
    in no set order."""
    found = {}
    for state in list(_REGISTERED) if model is None else delayed_states(model):
        for ref in _REGISTERED.get(state, ()):
            optimizer = ref()
            if optimizer is not None:
                found[id(optimizer)] = optimizer
    return list(found.values())


def may_be_stepped(model: nn.Module) -> bool:
    """Whether an optimizer may hold ``model``'s parameters: one registered for its scaling, or, for
    a model converted without an optimizer (watched), any. Not a copy made without its optimizer."""
    if registered_optimizers(model):
        return True
    held = {id(p) for p in model.parameters()}
    return any(id(p) in held for watched in list(_WATCHED) for p in watched.parameters())


def release_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Gives the scaling states that ``optimizer``'s hooks update over to the next optimizer
    registered for each: for an optimizer that will not step again (one that ``initialize``
    replaced), which as the first registered would keep them un-updated while anything holds it."""
    hooks = optimizer.__dict__.get("_fp8amp_step_hooks")
    if hooks is None:
        return
    for state, refs in list(_REGISTERED.items()):
        refs[:] = [r for r in refs if r is not hooks.optimizer]
        if not refs:
            del _REGISTERED[state]
    hooks.models.clear()
    hooks.walked = None
    _ownership_changed()


def hand_over_scaling(optimizer: torch.optim.Optimizer, new_optimizer: torch.optim.Optimizer) -> None:
    """Registers ``new_optimizer``, which replaces ``optimizer`` (``initialize``'s rebuild,
    ``unconvert``'s plain optimizer), for the models ``optimizer`` was registered for that still hold
    scaling states. A model that an earlier ``initialize`` (or ``convert(..., optimizer)``) registered
    on ``optimizer``, say the encoder of two models initialized one after the other with the
    optimizer the first call returned, otherwise kept its scales frozen once ``optimizer`` retired."""
    hooks = optimizer.__dict__.get("_fp8amp_step_hooks")
    for model in [] if hooks is None else list(hooks.models):
        if any(isinstance(m, ScalingState) for m in model.modules()):
            register_scaling_hooks(model, new_optimizer)


# torch.optim.Optimizer's dicts of the hooks registered on an optimizer.
_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


def carry_hooks(optimizer: torch.optim.Optimizer, new_optimizer: torch.optim.Optimizer) -> None:
    """Makes the hooks registered on ``optimizer`` (step, state_dict, load_state_dict) run on
    ``new_optimizer``, which replaces it (``initialize``'s rebuild): it takes the same dicts, so
    that the handles still remove them, and ``optimizer`` gets empty ones. fp8amp's own scaling
    hooks are left out: they update the models of ``optimizer``'s registration (the new one
    registers its own)."""
    for name in _HOOK_DICTS:
        hooks = getattr(optimizer, name)
        for key in [k for k, hook in hooks.items() if isinstance(getattr(hook, "__self__", None), _StepHooks)]:
            del hooks[key]
        setattr(new_optimizer, name, hooks)
        # Shared, the hooks registered on the new one next (its scaling hooks) ran at the steps of the
        # one given to initialize_optimizer, which is not retired: stepped by mistake, it updated the
        # scaling as if the new one had, or failed inside fp8amp once that one was gone.
        setattr(optimizer, name, type(hooks)())


def _reduce_registered(optimizer_ref: weakref.ref, protocol: int) -> tuple:
    """``__reduce_ex__`` of a registered optimizer: its class's state with the registered models,
    which the copy registers again (see _set_registered_state)."""
    optimizer = optimizer_ref()
    state = {k: v for k, v in optimizer.__getstate__().items() if k not in ("__reduce_ex__", "_fp8amp_step_hooks")}
    return _new_registered, (type(optimizer),), (state, optimizer.__dict__["_fp8amp_step_hooks"].models)


def _new_registered(cls: type) -> torch.optim.Optimizer:
    # Unpickling and copying set the state through the instance's __setstate__: this one sets it
    # with the class's, then registers the models. (Built first and the state set after, so a
    # model that refers back to its optimizer copies as any object cycle.)
    optimizer = copyreg.__newobj__(cls)
    optimizer.__setstate__ = functools.partial(_set_registered_state, weakref.ref(optimizer))
    return optimizer


def _set_registered_state(optimizer_ref: weakref.ref, state: tuple) -> None:
    optimizer = optimizer_ref()
    del optimizer.__dict__["__setstate__"]
    state, models = state
    optimizer.__setstate__(state)
    for model in models:
        register_scaling_hooks(model, optimizer)


def drop_skipped_amaxes(optimizer: torch.optim.Optimizer) -> None:
    """At ``optimizer.zero_grad()``: when it has not stepped since its previous ``zero_grad`` (a
    step GradScaler skipped, or that a loop skipped for a NaN loss), sets the inf / NaN amaxes that
    step left in this step's column of the states it updates to 0. The next step's warm-up casts
    fold their amax into that column: a non-finite one there made them take the stored scale (1
    before any update) instead of their own. Its finite amaxes stay, as after a skipped step; the
    warm-up goes on (no rank saw the inf at the next update, so every rank's counters agree)."""
    hooks = optimizer.__dict__.get("_fp8amp_step_hooks")
    if hooks is None or torch.compiler.is_compiling():
        return
    skipped, hooks.stepped = not hooks.stepped, False
    if skipped:
        drop_nonfinite_amaxes(hooks.states())


def update_scaling(model: nn.Module) -> None:
    """Delayed-scaling update of every ``Fp8Linear`` in ``model``; call after each optimizer step.
    One launch for all their input states and one for their output-gradient states. With several
    ranks, this step's amaxes are first MAX-reduced over the data-parallel group in one collective
    (:func:`fp8amp.amax_sync.reduce_amaxes`), so every rank gets the same scales; every rank of
    the group must call it. A model whose optimizer's hooks already update it
    (:func:`register_scaling_hooks`, which ``initialize`` and ``convert(..., optimizer)`` call)
    must not be updated again: that is warned, since its histories would roll twice a step."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"update_scaling: model must be an nn.Module, got {type(model).__name__}")
    states = delayed_states(model)
    if _REGISTERED and any(r() is not None for s in states for r in _REGISTERED.get(s, ())):  # (no hooks: no loop)
        warnings.warn("update_scaling: this model's scaling is already updated after every optimizer.step() by "
                      "the hooks of initialize / convert(..., optimizer) / register_scaling_hooks; a second "
                      "update a step rolls each amax history twice (half its window). Remove this call, or "
                      "convert without the optimizer and keep it", stacklevel=2)
    _update_states(states)


def _update_states(states: list[ScalingState]) -> None:
    with torch.no_grad():
        _reduce_amaxes(states)
        update_states(states)


# Models converted without an optimizer whose scaling no hooks update (yet); weak keys. Each
# optimizer that steps: (the watched models whose parameters it holds, ScalingState.updates_run
# at its previous step, which each state's updated_at is compared with, the ids of its parameters,
# the _watch_generation its models were found at: found again when models were watched since).
# Checked by one global step post-hook, there only while models are watched.
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
_STEPPED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[list, int, set, int]]" = weakref.WeakKeyDictionary()
_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# The layers watched since Fp8Linear's constructor built them (fp8amp.Fp8Linear(in, out), not convert).
_BUILT: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_watch_hook = None
_watch_generation = 0


def watch_scaling_updates(model: nn.Module) -> None:
    """Warns once if an optimizer steps ``model``'s parameters twice with no scaling update between
    (no :func:`update_scaling` by hand, no hooks): its delayed scales would stay in warm-up for the
    whole run, each set by the largest amax seen since the start. ``convert`` without an optimizer
    calls it; :func:`register_scaling_hooks` ends the watch."""
    global _watch_hook, _watch_generation
    if not delayed_states(model):  # (nothing delayed-scaled: nothing to update)
        return
    if model not in _WATCHED:
        _watch_generation += 1
    _unwatch_inside(model)  # (layers watched since they were built: the model's watch covers them)
    _WATCHED[model] = True
    if _watch_hook is None:
        _watch_hook = register_optimizer_step_post_hook(_check_step)


def _unwatch_inside(model: nn.Module) -> None:
    """Ends the watch of ``model`` and of the modules inside it."""
    if _WATCHED:
        for m in model.modules():
            _WATCHED.pop(m, None)


def _watch_built(layer: Fp8Linear) -> None:
    """An Fp8Linear built by its constructor (MS-AMP's ``FP8Linear`` used directly) is watched as a
    model converted without an optimizer is: stepped by an optimizer that nobody registered, its
    delayed scales stayed in warm-up for the whole run, silently."""
    _BUILT.add(layer)
    watch_scaling_updates(layer)


on_built.append(_watch_built)


def _watch_unstepped(model: nn.Module) -> None:
    """A registered model at a step that its optimizers did not take is watched again until one
    steps: a new optimizer built by hand for a new phase or epoch, not registered, froze its scales
    silently. (Warned once: not again after the warning.)"""
    if model not in _WARNED:
        watch_scaling_updates(model)


on_unstepped(_watch_unstepped)


def _stepped_states(model: nn.Module, held: set[int]) -> list[ScalingState]:
    """The delayed states of ``model``'s layers with a parameter among ``held`` (ids), or of all its
    layers where it holds none of theirs (adapters in plain Linears over frozen FP8 layers)."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    stepped = [m for m in layers if any(id(p) in held for p in m.parameters(recurse=False))]
    return [s for m in stepped or layers for s in delayed_states(m)]


def _models_holding(held: set[int]) -> list[weakref.ref]:
    """The watched models with a parameter among ``held`` (ids)."""
    return [weakref.ref(m) for m in list(_WATCHED) if any(id(p) in held for p in m.parameters())]


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    global _watch_hook
    if not _WATCHED:  # every watched model registered or gone: no hook on every optimizer's step
        _watch_hook.remove()
        _watch_hook = None
        _STEPPED.clear()
        return
    if torch.compiler.is_compiling():
        return
    seen = _STEPPED.get(optimizer)
    if seen is None:  # its first step: the parameters it holds, found once
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        _STEPPED[optimizer] = (_models_holding(held), ScalingState.updates_run, held, _watch_generation)
        return
    models, updates_then, held, generation = seen
    if generation != _watch_generation:  # (a model watched after this optimizer's first step)
        models = _models_holding(held)
    _STEPPED[optimizer] = (models, ScalingState.updates_run, held, _watch_generation)
    for ref in models:
        model = ref()
        if model is None or model not in _WATCHED:
            continue
        states = _stepped_states(model, held)
        if model in _BUILT and states and all(s in _REGISTERED for s in states):
            _WATCHED.pop(model)  # a built layer put into a registered model, whose hooks found it
            continue
        # Each of them: another model's update, or that of another part of this one (a registered
        # model inside it, say), says nothing of the layers this optimizer steps.
        if states and all(s.updated_at > updates_then for s in states):
            continue
        if _WATCHED.pop(model) and states:  # (none: unconverted since)
            _WARNED.add(model)
            warnings.warn(
                f"fp8amp: {type(optimizer).__name__}.step() updated the parameters of a model that fp8amp converted "
                "without an optimizer (or whose registered optimizer no longer steps), and nothing updated the "
                "model's FP8 scaling since its previous step: its delayed scales stay as they are (in warm-up, each "
                "set by the largest amax since the start, if never updated). Give the optimizer to fp8amp: "
                "fp8amp.initialize_optimizer(model, optimizer, opt_level) (O1/O2: also the level's state formats; "
                "step the optimizer it returns), or fp8amp.register_scaling_hooks(model, optimizer), or call "
                "fp8amp.update_scaling(model) after each optimizer.step()", stacklevel=2)
