package redact

import (
	"strings"
	"testing"
)

func TestURL(t *testing.T) {
	tests := []struct {
		name, in, want string
		secrets        []string
	}{
		{name: "empty", in: "", want: ""},
		{name: "nats plain", in: "nats://127.0.0.1:4222", want: "nats://127.0.0.1:4222"},
		{name: "nats user password", in: "nats://alice:s3cret@127.0.0.1:4222", want: "nats://alice:xxxxx@127.0.0.1:4222", secrets: []string{"s3cret"}},
		{name: "nats token", in: "nats://t0ken@127.0.0.1:4222", want: "nats://xxxxx@127.0.0.1:4222", secrets: []string{"t0ken"}},
		{name: "nats list", in: "nats://a:p1@h1:4222, nats://b:p2@h2:4222", want: "nats://a:xxxxx@h1:4222,nats://b:xxxxx@h2:4222", secrets: []string{"p1", "p2"}},
		{name: "comma in password", in: "nats://a:p,1x@h1:4222", secrets: []string{"p,1x", "1x@"}},
		{name: "postgres url", in: "postgres://bob:pgpw@db:5432/ids?sslmode=disable&password=qpw", want: "postgres://bob:xxxxx@db:5432/ids?sslmode=disable&password=xxxxx", secrets: []string{"pgpw", "qpw"}},
		{name: "postgres key value", in: "host=db user=bob password=pgpw dbname=ids", want: "host=db user=bob password=xxxxx dbname=ids", secrets: []string{"pgpw"}},
		{name: "postgres key value quoted", in: "host=db password='pg pw' dbname=ids", want: "host=db password=xxxxx dbname=ids", secrets: []string{"pg pw"}},
		{name: "mysql dsn", in: "leaf:mypw@tcp(db:3306)/leaf?parseTime=true", want: "leaf:xxxxx@tcp(db:3306)/leaf?parseTime=true", secrets: []string{"mypw"}},
		{name: "mysql dsn no password", in: "leaf@tcp(db:3306)/leaf", want: "leaf@tcp(db:3306)/leaf"},
		{name: "mysql dsn password with @", in: "leaf:my@pw@tcp(db:3306)/leaf", want: "leaf:xxxxx@tcp(db:3306)/leaf", secrets: []string{"my@pw"}},
		{name: "host port", in: "127.0.0.1:4222", want: "127.0.0.1:4222"},
		{name: "unknown form", in: "something secret@x", want: Mask, secrets: []string{"secret"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := URL(tt.in)
			if tt.want != "" && got != tt.want {
				t.Errorf("URL(%q) = %q, want %q", tt.in, got, tt.want)
			}
			for _, s := range tt.secrets {
				if strings.Contains(got, s) {
					t.Errorf("URL(%q) = %q: shows the secret %q", tt.in, got, s)
				}
			}
		})
	}
}
