package helm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const chartDir = "dispenser"

// release is the release the tests render: "ids" in namespace "ids", so
// that the full name is ids-dispenser.
var release = chartutil.ReleaseOptions{Name: "ids", Namespace: "ids", Revision: 1, IsInstall: true}

// valueSets are the values the chart is rendered with: what each must
// render (kind/name), or the error it must fail with.
var valueSets = []struct {
	name    string
	values  string
	want    []string // kind/name of every object rendered, sorted
	wantErr string
}{
	{
		// The metrics port (/status names every tenant's tags) admits
		// nobody but the kubelet's probes.
		name:   "defaults",
		values: ``,
		want: []string{"Deployment/ids-dispenser", "NetworkPolicy/ids-dispenser", "PodDisruptionBudget/ids-dispenser",
			"ServiceAccount/ids-dispenser"},
	},
	{
		// The values docs/deploy.md shows next to the NATS chart.
		name: "postgres, credentials, TLS, ServiceMonitor",
		values: `
config:
  nats:
    url: nats://nats.nats.svc:4222
    credentials: {secretName: dispenser-nats, key: worker.creds}
    jetStream:
      urlSecret: {name: dispenser-nats, key: js-url}
      credentials: {secretName: dispenser-nats-js, key: js.creds}
    tls: {secretName: dispenser-nats-tls, clientCertificate: true}
  postgres: {secretName: dispenser-postgres, key: url}
  env:
    DISPENSER_METRICS_TAGS: orders,invoices
    DISPENSER_MAX_WAIT: 200ms
serviceMonitor:
  enabled: true
  labels: {release: prometheus}
networkPolicy:
  metricsFrom:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}
      podSelector: {matchLabels: {app.kubernetes.io/name: prometheus}}
`,
		want: []string{"Deployment/ids-dispenser", "Job/ids-dispenser-migrate", "NetworkPolicy/ids-dispenser",
			"PodDisruptionBudget/ids-dispenser", "Service/ids-dispenser-metrics", "ServiceAccount/ids-dispenser",
			"ServiceMonitor/ids-dispenser"},
	},
	{
		name: "postgres without the migrate hook",
		values: `
config:
  postgres: {secretName: dispenser-postgres}
migrate: {enabled: false}
service: {enabled: true}
networkPolicy: {enabled: false}
`,
		want: []string{"Deployment/ids-dispenser", "PodDisruptionBudget/ids-dispenser", "Service/ids-dispenser-metrics",
			"ServiceAccount/ids-dispenser"},
	},
	{
		name: "sized, merged, no PDB nor service account",
		values: `
fullnameOverride: ids-workers
global: {labels: {team: platform}, image: {registry: registry.example.com, pullPolicy: Always}}
config:
  nats: {urlSecret: {name: nats-url}}
  shutdownTimeoutSeconds: 30
  bucketReplicas: 5
  metricsPort: 9100
deployment: {replicas: 8, merge: {spec: {revisionHistoryLimit: 3}}}
podTemplate:
  terminationGracePeriodSeconds: 31
  topologySpreadConstraints:
    topology.kubernetes.io/zone: {maxSkew: 2, whenUnsatisfiable: DoNotSchedule}
  merge: {spec: {nodeSelector: {pool: ids}, priorityClassName: high}}
container:
  image: {tag: v1.2.3}
  resources: {requests: {cpu: "2", memory: 256Mi}, limits: {cpu: "2", memory: 1Gi}}
  env:
    GOMAXPROCS: "2"
    GOMEMLIMIT: {valueFrom: {resourceFieldRef: {resource: limits.memory}}}
  merge: {terminationMessagePolicy: FallbackToLogsOnError}
podDisruptionBudget: {enabled: false}
serviceAccount: {enabled: false}
`,
		want: []string{"Deployment/ids-workers", "NetworkPolicy/ids-workers"},
	},
	{
		name: "network policy",
		values: `
networkPolicy:
  enabled: true
  metricsFrom:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}
      podSelector: {matchLabels: {app.kubernetes.io/name: prometheus}}
`,
		want: []string{"Deployment/ids-dispenser", "NetworkPolicy/ids-dispenser", "PodDisruptionBudget/ids-dispenser",
			"ServiceAccount/ids-dispenser"},
	},
	{
		name:   "network policy admitting nobody",
		values: `{networkPolicy: {enabled: true}}`,
		want: []string{"Deployment/ids-dispenser", "NetworkPolicy/ids-dispenser", "PodDisruptionBudget/ids-dispenser",
			"ServiceAccount/ids-dispenser"},
	},
	{
		name:    "a ServiceMonitor the network policy keeps out",
		values:  `{serviceMonitor: {enabled: true}}`,
		wantErr: "serviceMonitor.enabled: networkPolicy admits no scraper",
	},
	{
		name:    "a metrics Service the network policy keeps out",
		values:  `{service: {enabled: true}}`,
		wantErr: "service.enabled: networkPolicy admits no scraper",
	},
	{
		name:    "grace period not above the shutdown timeout",
		values:  `{config: {shutdownTimeoutSeconds: 20}, podTemplate: {terminationGracePeriodSeconds: 20}}`,
		wantErr: "podTemplate.terminationGracePeriodSeconds 20 must exceed config.shutdownTimeoutSeconds 20",
	},
	{
		name:    "no NATS URL",
		values:  `{config: {nats: {url: ""}}}`,
		wantErr: "config.nats.url (or config.nats.urlSecret.name) is required",
	},
	{
		name:    "a NATS password in config.nats.url",
		values:  `{config: {nats: {url: "nats://ids:s3cret@nats.nats.svc:4222"}}}`,
		wantErr: "config.nats.url holds a user, password or token",
	},
	{
		name:    "a NATS token in the second URL of config.nats.url",
		values:  `{config: {nats: {url: "nats://nats-0:4222,nats://s3cret@nats-1:4222"}}}`,
		wantErr: "config.nats.url holds a user, password or token",
	},
	{
		name:    "not a flag in config.env",
		values:  `{config: {env: {MAX_WAIT: 1s}}}`,
		wantErr: "'MAX_WAIT' does not match pattern",
	},
	{
		name:    "a database URL in config.env",
		values:  `{config: {env: {DISPENSER_POSTGRES_URL: "postgres://ids:secret@db/ids"}}}`,
		wantErr: "config.env.DISPENSER_POSTGRES_URL: the chart sets it from config.postgres.secretName",
	},
	{
		name:    "a MySQL DSN in config.env",
		values:  `{config: {env: {DISPENSER_MYSQL_URL: "ids:secret@tcp(db:3306)/ids"}}}`,
		wantErr: "config.env.DISPENSER_MYSQL_URL: the DSN holds a password",
	},
	{
		name:    "the NATS URL emptied in config.env",
		values:  `{config: {env: {DISPENSER_NATS_URL: ""}}}`,
		wantErr: "config.env.DISPENSER_NATS_URL: the chart sets it from config.nats.url",
	},
	{
		name:    "the shutdown timeout past the grace period in container.env",
		values:  `{container: {env: {DISPENSER_SHUTDOWN_TIMEOUT: 60s}}}`,
		wantErr: "container.env.DISPENSER_SHUTDOWN_TIMEOUT: the chart sets it from config.shutdownTimeoutSeconds",
	},
	{
		name:    "bucket replicas",
		values:  `{config: {bucketReplicas: 7}}`,
		wantErr: "'/config/bucketReplicas': maximum: got 7, want 5",
	},
	{
		name:    "a misspelt value",
		values:  `{podDisruptionBudgt: {enabled: false}}`,
		wantErr: "podDisruptionBudgt",
	},
	{
		name:    "a misspelt field merged in",
		values:  `{podTemplate: {merge: {spec: {nodeSelectr: {pool: ids}}}}}`,
		wantErr: `unknown field "nodeSelectr"`,
	},
}

// TestChart lints the chart and renders it with each value set, decodes
// every manifest strictly into its API type, and checks the workers' pods.
func TestChart(t *testing.T) {
	flags := binaryFlags(t)
	for _, tt := range valueSets {
		t.Run(tt.name, func(t *testing.T) {
			vals, err := chartutil.ReadValues([]byte(tt.values))
			if err != nil {
				t.Fatal(err)
			}
			objs, err := render(t, vals)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			lintChart(t, vals)
			var got []string
			for _, o := range objs {
				got = append(got, o.kind+"/"+o.name)
			}
			sort.Strings(got)
			if !slices.Equal(got, tt.want) {
				t.Errorf("rendered %q, want %q", got, tt.want)
			}
			checkObjects(t, objs, flags)
		})
	}
}

// lintChart runs helm lint (strict: warnings fail too) with vals.
func lintChart(t *testing.T, vals chartutil.Values) {
	t.Helper()
	l := lint.All(chartDir, vals, release.Namespace, false)
	for _, m := range l.Messages {
		if m.Severity >= support.WarningSev {
			t.Errorf("helm lint: %v", m)
		}
	}
}

// object is one rendered manifest, decoded.
type object struct {
	kind, name, file string
	obj              any
}

// kinds are the API types the chart may render, by apiVersion and kind.
var kinds = map[string]func() any{
	"apps/v1 Deployment":                      func() any { return new(appsv1.Deployment) },
	"batch/v1 Job":                            func() any { return new(batchv1.Job) },
	"policy/v1 PodDisruptionBudget":           func() any { return new(policyv1.PodDisruptionBudget) },
	"networking.k8s.io/v1 NetworkPolicy":      func() any { return new(networkingv1.NetworkPolicy) },
	"v1 Service":                              func() any { return new(corev1.Service) },
	"v1 ServiceAccount":                       func() any { return new(corev1.ServiceAccount) },
	"monitoring.coreos.com/v1 ServiceMonitor": func() any { return new(monitoringv1.ServiceMonitor) },
}

// render renders the chart with vals as `helm template` would and decodes
// every document strictly: a field its type does not have is an error.
func render(tb testing.TB, vals chartutil.Values) ([]object, error) {
	tb.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		tb.Fatal(err)
	}
	rv, err := chartutil.ToRenderValues(ch, vals, release, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	files, err := engine.Render(ch, rv)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	var objs []object
	for _, file := range names {
		if !strings.HasSuffix(file, ".yaml") {
			continue // NOTES.txt, helpers
		}
		for doc := range strings.SplitSeq(files[file], "\n---") {
			if strings.TrimSpace(strings.TrimPrefix(doc, "---")) == "" {
				continue
			}
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
				Metadata   struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				return nil, fmt.Errorf("%s: %w", file, err)
			}
			newObj, ok := kinds[head.APIVersion+" "+head.Kind]
			if !ok {
				return nil, fmt.Errorf("%s: %s %s is not a kind the tests know", file, head.APIVersion, head.Kind)
			}
			obj := newObj()
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				return nil, fmt.Errorf("%s: %s %s: %w", file, head.Kind, head.Metadata.Name, err)
			}
			objs = append(objs, object{kind: head.Kind, name: head.Metadata.Name, file: file, obj: obj})
		}
	}
	return objs, nil
}

// checkObjects checks what the service needs of the rendered objects.
func checkObjects(t *testing.T, objs []object, flags map[string][]string) {
	t.Helper()
	var services []*corev1.Service
	var podLabels labels.Set
	for _, o := range objs {
		switch v := o.obj.(type) {
		case *appsv1.Deployment:
			podLabels = v.Spec.Template.Labels
			sel := labels.SelectorFromSet(v.Spec.Selector.MatchLabels)
			if len(v.Spec.Selector.MatchLabels) == 0 || !sel.Matches(podLabels) {
				t.Errorf("Deployment selector %v does not select its pods %v", v.Spec.Selector.MatchLabels, podLabels)
			}
			if v.Spec.Strategy.RollingUpdate == nil || v.Spec.Strategy.RollingUpdate.MaxUnavailable.IntValue() != 0 {
				t.Errorf("Deployment strategy %+v: want a rolling update with maxUnavailable 0", v.Spec.Strategy)
			}
			checkWorkerPod(t, v.Spec.Template.Spec, flags)
		case *batchv1.Job:
			checkMigrateJob(t, v, flags)
		case *corev1.Service:
			services = append(services, v)
		}
	}
	for _, o := range objs {
		switch v := o.obj.(type) {
		case *policyv1.PodDisruptionBudget:
			if !labels.SelectorFromSet(v.Spec.Selector.MatchLabels).Matches(podLabels) {
				t.Errorf("PodDisruptionBudget selects %v, not the workers %v", v.Spec.Selector.MatchLabels, podLabels)
			}
			if v.Spec.MaxUnavailable == nil && v.Spec.MinAvailable == nil {
				t.Errorf("PodDisruptionBudget without maxUnavailable or minAvailable")
			}
		case *networkingv1.NetworkPolicy:
			checkNetworkPolicy(t, v, podLabels)
		case *corev1.Service:
			if v.Spec.Type != "" && v.Spec.Type != corev1.ServiceTypeClusterIP {
				t.Errorf("Service %s of type %s: the metrics port must not leave the cluster", v.Name, v.Spec.Type)
			}
			if !labels.SelectorFromSet(v.Spec.Selector).Matches(podLabels) {
				t.Errorf("Service %s selects %v, not the workers %v", v.Name, v.Spec.Selector, podLabels)
			}
		case *monitoringv1.ServiceMonitor:
			checkServiceMonitor(t, v, services)
		}
	}
}

// checkWorkerPod checks a worker's pod: the restricted security profile,
// the grace period against the shutdown timeout, the probes against the
// metrics port, and every DISPENSER_* variable against serve's flags.
func checkWorkerPod(t *testing.T, pod corev1.PodSpec, flags map[string][]string) {
	t.Helper()
	checkRestricted(t, "worker", pod)
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want the worker only", len(pod.Containers))
	}
	c := pod.Containers[0]
	env := checkEnv(t, c, flags)
	timeout, err := time.ParseDuration(env["DISPENSER_SHUTDOWN_TIMEOUT"])
	if err != nil || timeout <= 0 {
		t.Errorf("DISPENSER_SHUTDOWN_TIMEOUT %q: %v, want a positive duration", env["DISPENSER_SHUTDOWN_TIMEOUT"], err)
	}
	if g := pod.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second <= timeout {
		t.Errorf("terminationGracePeriodSeconds %v, not above the shutdown timeout %v: a stopping worker would be killed before it gives its segments back", deref(g), timeout)
	}
	_, port, err := net.SplitHostPort(env["DISPENSER_METRICS_ADDR"])
	if err != nil {
		t.Fatalf("DISPENSER_METRICS_ADDR %q: %v", env["DISPENSER_METRICS_ADDR"], err)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
	}{{"startup", c.StartupProbe}, {"readiness", c.ReadinessProbe}, {"liveness", c.LivenessProbe}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("no %s probe over HTTP", p.name)
			continue
		}
		if got := probePort(c, p.probe.HTTPGet); got != port {
			t.Errorf("%s probe on port %q (%v), the metrics server listens on %s", p.name, got, p.probe.HTTPGet.Port.String(), port)
		}
	}
	if c.ReadinessProbe != nil && c.ReadinessProbe.HTTPGet != nil && c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("readiness probe on %s, want /readyz", c.ReadinessProbe.HTTPGet.Path)
	}
	if c.LivenessProbe != nil && c.LivenessProbe.HTTPGet != nil && c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("liveness probe on %s, want /healthz (a worker that is alive but not ready must not be restarted)", c.LivenessProbe.HTTPGet.Path)
	}
	// Files named by variables lie in volumes mounted from Secrets.
	for _, name := range []string{"DISPENSER_NATS_CREDS", "DISPENSER_NATS_JS_CREDS", "DISPENSER_NATS_TLS_CA", "DISPENSER_NATS_TLS_CERT", "DISPENSER_NATS_TLS_KEY"} {
		if path, ok := env[name]; ok && !fromSecret(pod, c, path) {
			t.Errorf("%s=%s is not in a volume mounted from a Secret", name, path)
		}
	}
}

// checkMigrateJob checks the migrate hook: a pre-install/pre-upgrade Job
// running `dispenser migrate` with the PostgreSQL URL from a Secret.
func checkMigrateJob(t *testing.T, job *batchv1.Job, flags map[string][]string) {
	t.Helper()
	for _, hook := range []string{"pre-install", "pre-upgrade"} {
		if !slices.Contains(strings.Split(job.Annotations["helm.sh/hook"], ","), hook) {
			t.Errorf("Job %s: helm.sh/hook %q lacks %s", job.Name, job.Annotations["helm.sh/hook"], hook)
		}
	}
	pod := job.Spec.Template.Spec
	checkRestricted(t, "migrate", pod)
	if pod.RestartPolicy != corev1.RestartPolicyNever && pod.RestartPolicy != corev1.RestartPolicyOnFailure {
		t.Errorf("Job restartPolicy %q", pod.RestartPolicy)
	}
	if len(pod.Containers) != 1 || !slices.Equal(pod.Containers[0].Args, []string{"migrate"}) {
		t.Fatalf("Job containers %+v: want one running migrate", pod.Containers)
	}
	if env := checkEnv(t, pod.Containers[0], flags); env["DISPENSER_POSTGRES_URL"] != "<secret>" {
		t.Errorf("migrate Job: DISPENSER_POSTGRES_URL %q, want it from a Secret", env["DISPENSER_POSTGRES_URL"])
	}
}

// checkRestricted checks the restricted Pod Security Standard (non-root,
// no privilege escalation, every capability dropped, RuntimeDefault
// seccomp), and that nothing of the host is shared.
func checkRestricted(t *testing.T, what string, pod corev1.PodSpec) {
	t.Helper()
	psc := pod.SecurityContext
	if psc == nil {
		psc = &corev1.PodSecurityContext{}
	}
	if pod.HostNetwork || pod.HostPID || pod.HostIPC {
		t.Errorf("%s: shares the host's namespaces", what)
	}
	for _, v := range pod.Volumes {
		if v.HostPath != nil {
			t.Errorf("%s: hostPath volume %s", what, v.Name)
		}
	}
	for _, c := range slices.Concat(pod.InitContainers, pod.Containers) {
		sc := c.SecurityContext
		if sc == nil {
			t.Errorf("%s: container %s without a securityContext", what, c.Name)
			continue
		}
		if !isTrue(sc.RunAsNonRoot) && !isTrue(psc.RunAsNonRoot) {
			t.Errorf("%s: container %s may run as root (runAsNonRoot unset)", what, c.Name)
		}
		if u := cmpPtr(sc.RunAsUser, psc.RunAsUser); u != nil && *u == 0 {
			t.Errorf("%s: container %s runs as user 0", what, c.Name)
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("%s: container %s: allowPrivilegeEscalation %v, want false", what, c.Name, boolString(sc.AllowPrivilegeEscalation))
		}
		if isTrue(sc.Privileged) {
			t.Errorf("%s: container %s is privileged", what, c.Name)
		}
		if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 {
			t.Errorf("%s: container %s capabilities %+v, want all dropped, none added", what, c.Name, sc.Capabilities)
		}
		seccomp := sc.SeccompProfile
		if seccomp == nil {
			seccomp = psc.SeccompProfile
		}
		if seccomp == nil || (seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault && seccomp.Type != corev1.SeccompProfileTypeLocalhost) {
			t.Errorf("%s: container %s seccomp profile %+v, want RuntimeDefault", what, c.Name, seccomp)
		}
	}
}

// checkEnv checks that every DISPENSER_* variable of c is a flag of the
// command c runs, and returns the variables: their value, or "<secret>"
// for one taken from a Secret.
func checkEnv(t *testing.T, c corev1.Container, flags map[string][]string) map[string]string {
	t.Helper()
	if len(c.Args) == 0 {
		t.Fatalf("container %s runs the image's default arguments (an embedded nats-server), want a command", c.Name)
	}
	known := flags[c.Args[0]]
	if known == nil {
		t.Fatalf("container %s runs %q, not a command the tests know", c.Name, c.Args[0])
	}
	env := map[string]string{}
	for _, e := range c.Env {
		if _, dup := env[e.Name]; dup {
			t.Errorf("container %s: %s set twice", c.Name, e.Name)
		}
		switch {
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
			env[e.Name] = "<secret>"
		case e.ValueFrom != nil:
			env[e.Name] = "<field>"
		default:
			env[e.Name] = e.Value
		}
		if strings.HasPrefix(e.Name, "DISPENSER_") && !slices.Contains(known, e.Name) {
			t.Errorf("container %s sets %s, which `dispenser %s` does not read", c.Name, e.Name, c.Args[0])
		}
	}
	for _, secret := range []string{"DISPENSER_POSTGRES_URL", "DISPENSER_NATS_JS_URL"} {
		if v, ok := env[secret]; ok && v != "<secret>" {
			t.Errorf("container %s: %s given as a plain value, want it from a Secret", c.Name, secret)
		}
	}
	return env
}

// checkServiceMonitor checks that the ServiceMonitor selects a rendered
// Service and scrapes /metrics on a port of it.
func checkServiceMonitor(t *testing.T, sm *monitoringv1.ServiceMonitor, services []*corev1.Service) {
	t.Helper()
	sel := labels.SelectorFromSet(sm.Spec.Selector.MatchLabels)
	var svc *corev1.Service
	for _, s := range services {
		if sel.Matches(labels.Set(s.Labels)) {
			svc = s
		}
	}
	if svc == nil || len(sm.Spec.Selector.MatchLabels) == 0 {
		t.Fatalf("ServiceMonitor selects %v: no rendered Service has those labels", sm.Spec.Selector.MatchLabels)
	}
	if len(sm.Spec.Endpoints) != 1 {
		t.Fatalf("ServiceMonitor endpoints %+v, want one", sm.Spec.Endpoints)
	}
	ep := sm.Spec.Endpoints[0]
	if ep.Path != "/metrics" || !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == ep.Port }) {
		t.Errorf("ServiceMonitor scrapes %s on port %q; Service %s has %+v", ep.Path, ep.Port, svc.Name, svc.Spec.Ports)
	}
	// The alerts expect job="dispenser": the job label is the value of
	// jobLabel on the Service.
	if job := svc.Labels[sm.Spec.JobLabel]; job != "dispenser" {
		t.Errorf("ServiceMonitor's job would be %q (label %q of the Service), deploy/prometheus/alerts.yaml expects dispenser", job, sm.Spec.JobLabel)
	}
}

// probePort returns the container port number a probe's port names.
func probePort(c corev1.Container, g *corev1.HTTPGetAction) string {
	if g.Port.StrVal == "" {
		return strconv.Itoa(g.Port.IntValue())
	}
	for _, p := range c.Ports {
		if p.Name == g.Port.StrVal {
			return strconv.Itoa(int(p.ContainerPort))
		}
	}
	return "no container port named " + g.Port.StrVal
}

// fromSecret reports whether path lies in a volume of c mounted from a
// Secret of pod.
func fromSecret(pod corev1.PodSpec, c corev1.Container, path string) bool {
	for _, m := range c.VolumeMounts {
		if !strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") {
			continue
		}
		for _, v := range pod.Volumes {
			if v.Name == m.Name && v.Secret != nil {
				return true
			}
		}
	}
	return false
}

func isTrue(b *bool) bool { return b != nil && *b }

func boolString(b *bool) string {
	if b == nil {
		return "unset"
	}
	return strconv.FormatBool(*b)
}

func cmpPtr[T any](a, b *T) *T {
	if a != nil {
		return a
	}
	return b
}

func deref(p *int64) any {
	if p == nil {
		return "unset"
	}
	return *p
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// binary builds cmd/dispenser of the repository once and returns its path.
func binary(tb testing.TB) string {
	tb.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "dispenser-helm-test")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "dispenser")
		cmd := exec.Command("go", "build", "-o", binPath, "./cmd/dispenser")
		cmd.Dir = filepath.Join("..", "..")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build ./cmd/dispenser: %w\n%s", err, out)
		}
	})
	if buildErr != nil {
		tb.Fatal(buildErr)
	}
	return binPath
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

// binaryFlags returns the environment variables each command the chart
// runs reads, from the binary's own --help.
func binaryFlags(tb testing.TB) map[string][]string {
	tb.Helper()
	bin := binary(tb)
	flags := map[string][]string{}
	envLine := regexp.MustCompile(`^\s+env (DISPENSER_[A-Z0-9_]+)$`)
	for _, command := range []string{"serve", "migrate"} {
		out, _ := exec.Command(bin, command, "--help").CombinedOutput() // --help exits 2 after printing
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			if m := envLine.FindStringSubmatch(sc.Text()); m != nil {
				flags[command] = append(flags[command], m[1])
			}
		}
		if len(flags[command]) == 0 {
			tb.Fatalf("dispenser %s --help lists no environment variables:\n%s", command, out)
		}
	}
	return flags
}

// TestProbesServedByBinary runs the real binary with the environment the
// chart gives a worker (its literal values; NATS from an embedded server
// and the metrics address on a free loopback port instead of the
// cluster's) and its arguments, and checks that each probe's path answers
// 200 on the metrics server: a probe on a path the binary does not serve
// would restart or never admit every worker.
func TestProbesServedByBinary(t *testing.T) {
	bin := binary(t)
	vals, err := chartutil.ReadValues([]byte(`{config: {env: {DISPENSER_MAX_WAIT: 200ms}}}`))
	if err != nil {
		t.Fatal(err)
	}
	objs, err := render(t, vals)
	if err != nil {
		t.Fatal(err)
	}
	var c corev1.Container
	for _, o := range objs {
		if d, ok := o.obj.(*appsv1.Deployment); ok {
			c = d.Spec.Template.Spec.Containers[0]
		}
	}
	metrics, listen := freeAddr(t), freeAddr(t)
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(),
		"DISPENSER_METRICS_ADDR=" + metrics, "DISPENSER_NATS_LISTEN=" + listen, "DISPENSER_DATA_DIR=" + t.TempDir()}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil, e.Name == "DISPENSER_NATS_URL", e.Name == "DISPENSER_METRICS_ADDR":
			// the cluster's: replaced above
		case strings.HasSuffix(e.Name, "_REPLICAS"):
			env = append(env, e.Name+"=1") // one embedded server
		default:
			env = append(env, e.Name+"="+e.Value)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, c.Args...)
	cmd.Env = env
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 15 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		cmd.Wait()
		if t.Failed() {
			t.Logf("worker's log:\n%s", logs.String())
		}
	})
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
	}{{"startup", c.StartupProbe}, {"readiness", c.ReadinessProbe}, {"liveness", c.LivenessProbe}} {
		url := fmt.Sprintf("http://%s%s", metrics, p.probe.HTTPGet.Path)
		if err := waitOK(url, 60*time.Second); err != nil {
			t.Errorf("%s probe %s: %v", p.name, url, err)
		}
	}
}

// waitOK waits until url answers 200. 404 fails at once (the path is not
// served); other codes and refused connections are waited out (starting,
// not ready yet) until the deadline, which only bounds a hang.
func waitOK(url string, within time.Duration) error {
	deadline := time.Now().Add(within)
	last := errors.New("no answer")
	for time.Now().Before(deadline) {
		resp, err := http.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			switch resp.StatusCode {
			case http.StatusOK:
				return nil
			case http.StatusNotFound, http.StatusMethodNotAllowed:
				return fmt.Errorf("%s: the binary does not serve this path", resp.Status)
			}
			last = fmt.Errorf("%s %s", resp.Status, strings.TrimSpace(string(body)))
		} else {
			last = err
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("not 200 within %v: %w", within, last)
}

// freeAddr returns a loopback address with a port free a moment ago.
func freeAddr(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// checkNetworkPolicy: the policy selects the workers, restricts ingress,
// and admits only the metrics port, from the configured peers only (none
// when metricsFrom is empty: an empty from list would admit everyone).
func checkNetworkPolicy(t *testing.T, np *networkingv1.NetworkPolicy, podLabels labels.Set) {
	t.Helper()
	if !labels.SelectorFromSet(np.Spec.PodSelector.MatchLabels).Matches(podLabels) || len(np.Spec.PodSelector.MatchLabels) == 0 {
		t.Errorf("NetworkPolicy selects %v, not the workers %v", np.Spec.PodSelector.MatchLabels, podLabels)
	}
	if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) {
		t.Errorf("NetworkPolicy policy types %v: want Ingress", np.Spec.PolicyTypes)
	}
	for _, rule := range np.Spec.Ingress {
		for _, p := range rule.Ports {
			if p.Port == nil || p.Port.String() != "metrics" {
				t.Errorf("NetworkPolicy admits port %v: want only the metrics port", p.Port)
			}
		}
		if len(rule.Ports) == 0 {
			t.Errorf("NetworkPolicy rule %+v admits every port", rule)
		}
		if len(rule.From) == 0 {
			t.Errorf("NetworkPolicy rule %+v admits every peer", rule)
		}
	}
}
