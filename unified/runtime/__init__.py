"""The worker runtime: what every training process runs beside the user's script, whatever the
backend.

Where the process stands in the job (`environment`: torchrun's and the schedulers' variables,
restarts, devices), the collectives with timeouts built on a backend's primitives
(`collectives`), the watchdog that ends a process whose group broke (`watchdog`), preemption
signals and the exit they lead to (`preemption`), seeds and RNG streams (`rng`), nested
containers of arrays (`tree`), the network route to the main process (`network`) and the C
library calls (`libc`). Nothing here imports a framework.
"""
