"""The launcher: what runs in `unified launch`, never in a worker.

It parses the command line (`cli`, `launch`), starts and supervises one machine's processes
(`processes`: output prefixed with the process index, the first failure stops the others,
signals forwarded with a grace period), restarts the group under ``--max-restarts``
(`restarts`: spares started ahead on one machine, every machine together through machine 0's
`rendezvous`, which trusts only requests signed with the job's secret, `job_secret`), keeps
each child from outliving it (`parent_watch`, the wrapper every child runs through) and prints
``unified env`` (`report`). A backend says how its group starts with a `launch.Launcher`.
It imports no framework.
"""
