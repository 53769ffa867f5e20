"""Everything that runs the system: worker processes and their GPU placement, Ray actors, `serve`, `up` / `down`.

The manifests beside this package (kuberay/, ray/, prometheus/, grafana/) deploy the same pieces on clusters.
"""
