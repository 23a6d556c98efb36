"""Where NaN/Inf logits come from: after a step's logits come out non-finite, the step is re-run once with a
hook on every module to name the first one whose output went non-finite (never on the decoding path)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from clover_lite.errors import NonFiniteError


class _Found(Exception):
    """Stops a hooked re-run at the module where non-finite values arose."""


def _float_tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a module's output: tensors, tuples, lists, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.device.type != "meta":
            yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _float_tensors(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _float_tensors(o, depth + 1)
    elif depth < 4 and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _float_tensors(getattr(obj, f.name), depth + 1)


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def find_nonfinite_module(model: torch.nn.Module, run: Callable[[], object]) -> tuple[str | None, object]:
    """Run `run()` with a forward hook on every submodule of `model` and return (the name of the module where
    NaN/Inf first appear, run's result or None when stopped there). That module is the first, in the order
    the forwards finish, whose output holds a non-finite value while its tensor arguments (the top-level
    positional and keyword ones, not the cache views passed in tuples) are all finite: the module that made
    them, not one that merely passed them on. A child's forward finishes before its parent's, so the name is
    as deep as the hooks can see (a tensor a module uses directly, outside any child, names that module).
    When no module qualifies, the first with any non-finite output is named. Each hook checks with a host
    sync: for a diagnosis after a failure, never on the decoding path."""
    first_any: list[str] = []
    handles = []

    def hook(name):
        def check(module, args, kwargs, output):
            if _all_finite(_float_tensors(output)):
                return
            if not first_any:
                first_any.append(name)
            inputs = [a for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if _all_finite(inputs):
                raise _Found(name)
        return check

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    try:
        result = run()
    except _Found as found:
        return found.args[0], None
    finally:
        for h in handles:
            h.remove()
    return (first_any[0] if first_any else None), result


def nonfinite_error(runner, before: Sequence[int], block: Sequence[int], positions: Sequence[int],
                    block_start: int) -> NonFiniteError:
    """The error for a step whose logits held NaN/Inf: the step is re-run once (runner.replay, or its step)
    with hooks to name the module where the non-finite values arise."""
    model = runner.model
    replay = getattr(runner, "replay", None)

    def run():
        with torch.no_grad():
            return replay(before, block, positions) if replay is not None else runner.step(block, positions)

    name, logits = find_nonfinite_module(model, run)
    if name is None and isinstance(logits, torch.Tensor) and not bool(torch.isfinite(logits).all()):
        # Only the output projection is left, and it is no module's forward when tied to the embedding.
        name = "embed_tokens" if getattr(model, "lm_head", None) is None else "lm_head"
    dtype = getattr(getattr(model, "embed_tokens", None), "weight", torch.empty(0)).dtype
    head = (f"the model's logits are NaN/Inf at the denoising step of the block at position {block_start}, so "
            "no token can be chosen")
    fix = ("Check the checkpoint: load it with the NaN/Inf scan on (the default; without check_finite=False / "
           "--no-check-finite) to name the tensor, then re-download or re-export it")
    if name is None:
        return NonFiniteError(
            f"{head}; re-running the step with hooks on every module found no module output that is NaN/Inf "
            f"(the failure did not repeat). {fix}; if the weights are finite, try a dtype other than {dtype}.")
    where = name + (" (the tied lm_head)" if name == "embed_tokens" and model.lm_head is None else "")
    wider = {torch.float16: "bfloat16 or float32", torch.bfloat16: "float32"}.get(dtype)
    overflow = f"; if its weights are finite, its values overflow {dtype}: load with dtype {wider}" if wider else ""
    return NonFiniteError(
        f"{head}: the first module whose output went NaN/Inf (the step re-run with hooks) is '{where}'. "
        f"{fix}{overflow}.",
        module=name,
    )
