"""Lean kernel launches: a compiled Triton kernel is launched without `JITFunction.run`'s per-call Python.

A prefill step of a 9B hybrid makes ~360 Triton launches and is bound by the host's time to queue them
(bench/results/h200/serving/). Per launch, `kernel[grid](...)` costs tens of microseconds of
Python in Triton itself: option and knob reads, a string built from the options for the cache key, a check of
the kernel's globals, launch metadata and two (empty) hook chains called from C, and, for autotuned kernels, the
autotuner's key built from dicts of every argument. `lean_launch` keeps what decides correctness, Triton's own
argument binder (its C++ specialization: dtypes, 16-byte alignment, divisibility and ones of integers), and
replaces the rest by one dict lookup keyed on that specialization and the launch options, then calls the
compiled kernel's C launcher directly.

The first launch of each specialization goes through Triton (compiling or autotuning it), as does every launch
under the interpreter, while a launch hook is installed (profilers), when HYBRIDSERVE_LEAN_LAUNCH=0, or on a
Triton release whose internals were not checked against this file (LEAN_TRITON_RELEASES). Triton's knobs
(debug, instrumentation) are read when a specialization is first compiled, not on every launch. Hand-written:
Triton has no public launch path without this per-call work (its `CompiledKernel[grid]` still builds launch
metadata and reads the current device per call).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton import knobs

from hybridserve.kernels.triton_utils import interpreting

log = logging.getLogger(__name__)

# Triton releases whose JITFunction / Autotuner / CudaLauncher internals this file was written against and tested on
LEAN_TRITON_RELEASES = ("3.6",)


def lean_enabled() -> bool:
    """Whether lean launches are on in this process (read once per kernel, at its first launch)."""
    return (os.environ.get("HYBRIDSERVE_LEAN_LAUNCH", "1") != "0" and not interpreting()
            and triton.__version__.rsplit(".", 1)[0] in LEAN_TRITON_RELEASES)


def _hooks_installed() -> bool:
    runtime = knobs.runtime
    return bool(getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)
                or getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook))


class _Compiled:
    """What launching one compiled specialization needs, taken from Triton's CompiledKernel once."""

    __slots__ = ("launch", "function", "cooperative", "pdl", "packed", "launcher", "scratch")

    def __init__(self, kernel: Any) -> None:
        launcher = kernel.run  # initialises the module handles on first access
        self.launcher = launcher
        self.launch = launcher.launch
        self.function = kernel.function
        self.cooperative = launcher.launch_cooperative_grid
        self.pdl = launcher.launch_pdl
        self.packed = kernel.packed_metadata
        # kernels that need global or profile scratch keep Triton's launcher (it allocates the scratch)
        self.scratch = bool(launcher.global_scratch_size or launcher.profile_scratch_size)


class LeanKernel:
    """A @triton.jit or @triton.autotune kernel with lean launches: `kernel[grid](*args, **kwargs)` as Triton's.
    `fn` is the wrapped kernel (as an autotuner's `fn`); every other attribute, read or set, is the wrapped
    kernel's (an autotuner's `configs`, `cache`, `best_config`, ...), so tests can pin configs as before."""

    __slots__ = ("kernel", "_tuner", "_jit", "_compiled", "_binders", "_enabled", "_arg_names")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        tuner = isinstance(kernel, triton.runtime.Autotuner)
        self._tuner = kernel if tuner else None
        self._jit = kernel.fn if tuner else kernel
        self._compiled: dict[tuple, _Compiled] = {}
        self._binders: dict[int, Callable[..., Any]] = {}
        self._enabled: bool | None = None
        self._arg_names = frozenset(kernel.arg_names) if tuner else frozenset()

    @property
    def fn(self) -> Any:
        return self.kernel

    def __getattr__(self, name: str) -> Any:
        if name in LeanKernel.__slots__:  # not set yet (a failed __init__): never recurse through `kernel`
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in LeanKernel.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.kernel, name, value)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """Launch on the current device and stream (the first launch of a specialization through Triton)."""
        if self._enabled is None:
            self._enabled = lean_enabled()
        if not self._enabled or _hooks_installed():
            self.kernel[grid](*args, **kwargs)
            return
        if self._tuner is not None:
            config = self._tuned_config(args, kwargs)
            if config is None:  # not tuned yet for this key, or a config with a pre-hook: the autotuner's path
                self.kernel[grid](*args, **kwargs)
                return
            kwargs = {**kwargs, **config.all_kwargs()}
        device = torch._C._cuda_getDevice()
        binder = self._binders.get(device)
        if binder is None:
            binder = self._binders[device] = self._jit.device_caches[device][4]
        bound, specialization, options = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:  # compile (or find in Triton's caches) and launch through Triton, then keep it
            kernel = self._jit.run(*args, grid=grid, warmup=False, **kwargs)
            if kernel is not None:
                self._compiled[key] = _Compiled(kernel)
            return
        if callable(grid):
            grid = grid(bound)
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        if compiled.scratch:
            compiled.launcher(gx, gy, gz, stream, compiled.function, compiled.packed, None, None, None,
                              *bound.values())
            return
        compiled.launch(gx, gy, gz, stream, compiled.function, compiled.cooperative, compiled.pdl, None, None,
                        compiled.packed, None, None, None, *bound.values())

    def _tuned_config(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The autotuner's chosen config for these arguments, or None when it has none yet or the config has a
        pre-hook (both: the autotuner's own path). The key is the autotuner's: its key arguments' values, then
        the dtype of every tensor argument in order."""
        tuner = self._tuner
        assert tuner is not None  # only called for autotuned kernels
        if len(tuner.configs) == 1:
            config = tuner.configs[0]
        else:
            named = dict(zip(tuner.arg_names, args))
            if kwargs:
                named.update((k, v) for k, v in kwargs.items() if k in self._arg_names)
            key = [named[k] for k in tuner.keys if k in named]
            key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
            config = tuner.cache.get(tuple(key))
        if config is None or config.pre_hook is not None:
            return None
        tuner.best_config = config
        return config


def lean_launch(kernel: Any) -> LeanKernel:
    """Decorator: `kernel` (a @triton.jit or @triton.autotune object) launched the lean way."""
    return LeanKernel(kernel)
