// Package helm holds no code: its tests lint and render the Helm chart in
// dispenser/ with Helm's Go SDK, check every rendered manifest strictly
// against the Kubernetes API types (and the Prometheus Operator's
// ServiceMonitor), and check what matters to the service against the real
// binary: every DISPENSER_* variable the chart sets is a flag of the
// command it runs, the probes' paths and port are served, the grace period
// exceeds the shutdown timeout, the pods meet the restricted Pod Security
// Standard. It is a module of its own so that Helm and the Kubernetes
// libraries stay out of the service's module; ./test.sh at the repository root runs it. See
// docs/deploy.md.
package helm
