package segment

import (
	"sync"
	"sync/atomic"
)

// tagMap maps tag names to buffers for any number of tags. It is safe for
// concurrent use.
//
// A lookup of a tag in the read snapshot takes no lock and does not
// allocate. Tags added since the snapshot sit in a small map under a mutex,
// and dropped buffers (removed or idle tags) stay in the snapshot marked
// dropped; once those two together reach an eighth of the snapshot, the
// snapshot is rebuilt. So adding or dropping a tag costs O(1) amortized,
// whatever the number of tags, instead of a copy of the whole map. A tag
// found in added takes the mutex: once such lookups (misses) reach the
// number of tags, the snapshot is rebuilt too, so that a tag in use is
// soon looked up without the lock (with few tags, under the eighth, it
// would never be), again at O(1) amortized: the copy is paid for by as
// many lookups that took the mutex.
type tagMap struct {
	read atomic.Pointer[map[string]*buffer] // never written once stored

	// mu comes after the Allocator's refreshMu and before its mu (the lock
	// order is written at Allocator): add calls make under it.
	mu sync.Mutex // protects added and stale, and rebuilding read
	// added holds the tags added since read was built.
	added map[string]*buffer
	// stale counts the buffers in read that were dropped since.
	stale int
	// misses counts the lookups that found their tag in added since.
	misses int
}

func newTagMap() *tagMap {
	m := &tagMap{added: map[string]*buffer{}}
	m.read.Store(&map[string]*buffer{})
	return m
}

// get returns tag's live buffer, or nil.
func (m *tagMap) get(tag string) *buffer {
	if b := (*m.read.Load())[tag]; b != nil && !b.dropped.Load() {
		return b
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	b := m.added[tag]
	if b != nil {
		if m.misses++; m.misses >= len(*m.read.Load())+len(m.added) {
			m.rebuild()
		}
	}
	return b
}

// add returns tag's live buffer, adding the one make returns if there is
// none; added reports whether it did.
func (m *tagMap) add(tag string, make func() *buffer) (b *buffer, added bool) {
	if b := m.get(tag); b != nil {
		return b, false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if b := m.added[tag]; b != nil {
		return b, false
	}
	if b := (*m.read.Load())[tag]; b != nil && !b.dropped.Load() {
		return b, false
	}
	b = make()
	m.added[b.tag] = b // b's own copy of the name: one string per tag
	m.maybeRebuild()
	return b, true
}

// drop marks b dropped and forgets it, if it is tag's buffer. It reports
// whether it was.
func (m *tagMap) drop(tag string, b *buffer) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.added[tag] == b:
		delete(m.added, tag)
	case (*m.read.Load())[tag] == b && !b.dropped.Load():
		m.stale++
	default:
		return false
	}
	b.dropped.Store(true)
	m.maybeRebuild()
	return true
}

// maybeRebuild folds added into a new snapshot without the dropped buffers
// once the changes reach an eighth of the snapshot. m.mu must be held.
func (m *tagMap) maybeRebuild() {
	if len(m.added)+m.stale >= 64+len(*m.read.Load())/8 {
		m.rebuild()
	}
}

// rebuild folds added into a new snapshot without the dropped buffers.
// m.mu must be held.
func (m *tagMap) rebuild() {
	read := *m.read.Load()
	next := make(map[string]*buffer, len(read)-m.stale+len(m.added))
	for k, b := range read {
		if !b.dropped.Load() {
			next[k] = b
		}
	}
	for k, b := range m.added {
		next[k] = b
	}
	m.read.Store(&next)
	m.added = map[string]*buffer{}
	m.stale, m.misses = 0, 0
}

// all returns every live buffer.
func (m *tagMap) all() []*buffer {
	m.mu.Lock()
	defer m.mu.Unlock()
	read := *m.read.Load()
	out := make([]*buffer, 0, len(read)+len(m.added))
	for _, b := range read {
		if !b.dropped.Load() {
			out = append(out, b)
		}
	}
	for _, b := range m.added {
		out = append(out, b)
	}
	return out
}

// len returns the number of live buffers.
func (m *tagMap) len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(*m.read.Load()) - m.stale + len(m.added)
}
