"""Why the executor refuses a step before anything of it ran."""

from __future__ import annotations


class BatchRefused(ValueError):
    """A step names the padding sink, an index out of range or a slot twice, does not
    follow the step it was planned on top of, or extends a page table the executor does
    not hold as the step assumes."""
