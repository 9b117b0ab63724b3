// Package deploy holds no code: its tests check the deployment artifacts
// beside it and at the repository root with the real tools: the image
// (Dockerfile, podman), the alerting rules (prometheus/alerts.yaml,
// promtool) and the Grafana dashboard (grafana/dispenser.json, a real
// Prometheus scraping a real worker). The Helm chart in helm/ is tested by
// a module of its own there. See docs/deploy.md.
package deploy
