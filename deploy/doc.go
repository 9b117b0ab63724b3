// Package deploy holds no code: its tests check the deployment artifacts
// beside it and at the repository root (Dockerfile, prometheus/alerts.yaml)
// with the real tools, podman and promtool. See docs/deploy.md.
package deploy
