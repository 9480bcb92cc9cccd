"""A Triton kernel launched many times with one grid and the same arguments but a few.

A step's attention runs once per layer with the same sequences, grid and tile config; only the
layer's tensors change. Through ``kernel[grid](...)`` every launch pays Triton's argument
binder and cache lookup (tens of µs for a kernel of ~40 arguments); a mixed step's 32 eager
attentions spent more host time than its graphs' GPU time. ``RepeatedLaunch`` binds once: the
first call launches through the JIT (compiling if need be) and keeps the compiled kernel's
launcher; later calls hand it the argument list with the changed ones swapped in.

The caller guarantees that what Triton specializes on is the same at every call: dtypes,
the ints it specializes (strides: equal to 1 or divisible by 16) and the 16-byte alignment of
each pointer not in the kernel's ``do_not_specialize``. Under Triton's interpreter a launch
returns no compiled kernel, so every call goes through the JIT, with the same argument list.
"""

from __future__ import annotations

from typing import Any


class RepeatedLaunch:
    """``kernel[grid](**args, **options)``, callable again with some arguments replaced."""

    def __init__(self, kernel, grid: tuple[int, ...], args: dict[str, Any],
                 options: dict[str, Any]) -> None:
        """args: every argument of the kernel, constexprs included, by name; options: launch
        keywords (num_warps, num_stages, launch_pdl)."""
        names = list(kernel.arg_names)
        if set(names) != set(args):
            raise ValueError(f"arguments {sorted(set(names) ^ set(args))} do not match "
                             f"the kernel's signature")
        # (a compiled kernel's launcher takes three grid dimensions)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.kernel, self.options, self.names = kernel, options, names
        self.args = [args[name] for name in names]  # the kernel's signature order
        self.index = {name: i for i, name in enumerate(names)}
        self.launcher = None  # the compiled kernel's, after the first launch

    def __call__(self, **changed: Any) -> None:
        """Launch on the current stream with ``changed`` arguments (by name) replacing the
        planned ones for this launch only."""
        args = self.args.copy()
        for name, value in changed.items():
            args[self.index[name]] = value
        if self.launcher is not None:
            self.launcher(*args)
            return
        compiled = self.kernel[self.grid](**dict(zip(self.names, args)), **self.options)
        if compiled is not None and hasattr(compiled, "__getitem__"):  # (interpreter: None)
            self.launcher = compiled[self.grid]
