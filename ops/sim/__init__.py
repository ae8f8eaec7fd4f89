"""Cluster simulation for dispatch policies: traces, workload, discrete-event cluster, reports.

The simulator imports the production routing policies (``app.routing``) and batch scheduler
(``workers.engine.scheduler``) rather than copies, so what it measures is the code that runs.
"""
