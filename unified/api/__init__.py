"""The `unified.Accelerator`'s public calls, by concern, each a class mixed into it: `jobs`
(running and deferring jobs, collectives), `checkpointing` (save and load), `training` (the
training loop), `tracking` (experiment trackers); and `prepared` (`PreparedObjects`, what
``prepare`` returned, an object the Accelerator owns). `unified.accelerator` keeps what wires
them together: construction, identity, ``prepare`` and ``end_training``. Accelerate's smaller
names are `unified.compat`'s. Runs in each worker."""
