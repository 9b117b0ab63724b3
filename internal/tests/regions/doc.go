// Package regions tests dispenser across a NATS supercluster
// (docs/regions.md): one cluster per region on 127.0.0.1, joined by
// gateways through fault proxies that add WAN latency and cut regions
// apart, with workers and clients in every region. It has tests only.
//
// Short mode (part of go test ./...): two regions, 30 ms each way between
// them, leases of 2 s, cuts of several leases. DISPENSER_REGIONS_LONG=1:
// three regions, 30-80 ms, the default snowflake lease and longer cuts.
package regions
