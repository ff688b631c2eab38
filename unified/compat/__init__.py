"""Accelerate's compatibility names: what an Accelerate script calls that unified's own design
does not need, each a thin layer over the `unified.Accelerator`.

The smaller ``Accelerator`` methods and decorators (`surface`), ``AcceleratorState`` and its
relatives (`state`), the collectives of ``accelerate.utils`` that act through the live
Accelerator (`operations`), and the kwargs handlers (`kwargs_handlers`). ``unified.utils``
is where a script finds them. Runs in each worker.
"""
