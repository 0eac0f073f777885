"""The per-host sidecar: samples sensors, knows which jobs hold which devices, pushes batches.

runner      wiring: events, the worker thread, the schedule, the local API's handler
sampler     sensor readings -> intervals, closed at every tick and job boundary
jobs        the job registry; CPU time per job tree
tracker     GPU processes tick by tick: explicit jobs bound by ancestry, discovered jobs started/ended
discover    which job an untagged process belongs to (environ, Slurm, Kubernetes, heuristics) and why
procfs      per-process reads of a passed-in /proc;  kubelet: pod metadata by UID
sharing     utilisation weights for shared GPUs, settled once NVML's samples cover the interval
scrape      serving engines' Prometheus counters -> QueryCount windows
requests    local-API messages -> jobs and spans;  local_api: the Unix socket
outbox      pending records -> numbered batches;  spool: durable queue;  push: HTTP to the collector
options     WATTWATCH_* settings for discovery and scraping
"""
