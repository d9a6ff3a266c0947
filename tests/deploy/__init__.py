"""Tests of deploy/: Prometheus alert rules, the Grafana dashboard, the Kubernetes manifests."""
