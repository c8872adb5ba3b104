package relay

import (
	"fmt"
	"testing"
	"time"
)

// TestResponseStoreOrder checks the store's bound, its expiry and its
// order: a response used is the last evicted, one unused for its TTL is
// gone, and a slot freed is reused rather than the slab growing.
func TestResponseStoreOrder(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	s := newResponseStore(time.Minute, 3)
	for i := range 3 {
		s.put(fmt.Sprint("resp", i), fmt.Sprint("agent", i), "", "m", t0)
	}
	if _, ok := s.get("resp0", t0); !ok { // resp0 now the most recent
		t.Fatal("resp0 missing before the bound was reached")
	}
	s.put("resp3", "agent3", "", "m", t0) // evicts the least recent: resp1
	if _, ok := s.get("resp1", t0); ok {
		t.Error("resp1 kept past the bound: the least recently used was not evicted")
	}
	for _, id := range []string{"resp0", "resp2", "resp3"} {
		if _, ok := s.get(id, t0); !ok {
			t.Errorf("%s evicted; want resp1 evicted", id)
		}
	}
	s.put("resp2", "agent9", "", "m2", t0)
	if e, _ := s.get("resp2", t0); e.agent != "agent9" || e.model != "m2" {
		t.Errorf("resp2 after a second put = %+v; want agent9, m2", e)
	}

	// resp3 used late; the others expire a minute after their last use.
	late := t0.Add(50 * time.Second)
	s.get("resp3", late)
	if _, ok := s.get("resp0", t0.Add(61*time.Second)); ok {
		t.Error("resp0 returned 61s after its last use; TTL 1m")
	}
	if _, ok := s.get("resp3", t0.Add(61*time.Second)); !ok {
		t.Error("resp3 expired 11s after its last use")
	}
	s.drop("resp3")
	if _, ok := s.get("resp3", t0.Add(61*time.Second)); ok {
		t.Error("resp3 returned after drop")
	}
	if n := len(s.byID); n != 0 {
		t.Errorf("%d entries left; want 0", n)
	}
	grown := len(s.entries)
	for i := range 3 {
		s.put(fmt.Sprint("again", i), "a", "", "m", t0.Add(2*time.Minute))
	}
	if len(s.entries) != grown {
		t.Errorf("slab grew from %d to %d slots refilling freed ones", grown, len(s.entries))
	}
}
