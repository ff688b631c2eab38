"""Accelerate's compatibility names: what an Accelerate script calls that unified's own design
does not need, each a thin layer over the `unified.Accelerator`.

The smaller ``Accelerator`` methods and decorators (`surface`) and those of features unified
does not have (`unsupported`), the save- and load-state pre hooks (`hooks`),
``AcceleratorState`` and its relatives (`state`), the collectives of ``accelerate.utils`` that
act through the live Accelerator (`operations`), and the kwargs handlers (`kwargs_handlers`).
They are composed onto the Accelerator: they read only its public names, declared by
`host.SurfaceHost`, and the objects it hands them (`host.HostParts`), never its private
attributes. ``unified.utils`` is where a script finds them. Runs in each worker.
"""
