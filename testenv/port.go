package testenv

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// ServerPort returns a free TCP port on 127.0.0.1 for a server that may be
// stopped and started again on it. It lies below the kernel's ephemeral
// port range: a port from that range could be taken, while the server is
// down, by the outgoing connection of a client reconnecting to it.
func ServerPort() (int, error) {
	low := 32768 // Linux default
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	const first = 10000
	if low <= first+1000 {
		return 0, fmt.Errorf("testenv: the ephemeral port range starts at %d: no room for server ports below it", low)
	}
	for range 1000 {
		port := first + rand.IntN(low-first)
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			l.Close()
			return port, nil
		}
	}
	return 0, fmt.Errorf("testenv: no free port in %d..%d", first, low-1)
}
