"""The Triton interpreter, minus three repeated costs that were about half of its time in the suite.
Nothing a kernel computes changes.

- It patches triton.language for a launch, then again on every call of a @triton.jit helper inside it
  (InterpretedFunction.__call__ -> _patch_lang: an inspect.getmembers of the language's modules each time),
  and our kernels call helpers in their K loops. `faster_interpreter()` skips a helper's re-patch when the
  enclosing launch has already patched every language module the helper sees (the re-patch changes nothing
  then: its scope is discarded, never restored). A launch, and a helper that sees a module the launch did not
  patch, patch as before.
- _get_np_dtype builds a dict of 19 dtypes on each of its calls (every cast, splat and load): here a
  lookup remembered per scalar type, the original for anything else.
- Its sanitize_overflow option (on by default there; a GPU build checks only in debug mode) redoes every
  signed integer add, sub and mul in int64 and asserts the result fits: about a third of an interpreted INT4
  GEMV. Off here. At test shapes no offset comes near 2**31, so the check cannot fire on our address
  arithmetic; an offset gone wrong (a garbage row index, a bad stride) is what tests/triton_memcheck.py
  catches, at the address it reaches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import triton.language as tl
from triton.runtime import interpreter


@contextlib.contextmanager
def faster_interpreter():
    patched: list[set[int]] = []  # per active launch (innermost last): the language modules it has patched
    langs_of: dict = {}
    np_dtypes: dict[str, object] = {}
    executor = interpreter.GridExecutor
    call, patch_lang, get_np_dtype = executor.__call__, interpreter._patch_lang, interpreter._get_np_dtype

    def _langs(fn) -> set[int]:  # the language modules _patch_lang would patch for fn
        if fn not in langs_of:
            langs_of[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return langs_of[fn]

    def np_dtype(tt):
        scalar = tt.element_ty if type(tt) is tl.block_type else tt
        if type(scalar) is not tl.dtype:  # pointers and anything unusual: as the interpreter does
            return get_np_dtype(tt)
        if scalar.name not in np_dtypes:
            np_dtypes[scalar.name] = get_np_dtype(scalar)
        return np_dtypes[scalar.name]

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return call(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch(fn):
        langs = _langs(fn)
        if patched and langs <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's scope restores it all
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= langs
        return scope

    builder = interpreter.interpreter_builder
    options = builder.options
    executor.__call__, interpreter._patch_lang, interpreter._get_np_dtype = launch, patch, np_dtype
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    try:
        yield
    finally:
        executor.__call__, interpreter._patch_lang, interpreter._get_np_dtype = call, patch_lang, get_np_dtype
        builder.options = options
