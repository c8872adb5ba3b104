package scheduler

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParsePolicy(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want Policy
		err  bool
	}{
		{"sticky", PolicySticky, false},
		{"", PolicySticky, false},
		{"round-robin", PolicyRoundRobin, false},
		{"Random", PolicyRandom, false},
		{" least-loaded ", PolicyLeastLoaded, false},
		{"consistent-hash", PolicyConsistentHash, false},
		{"roundrobin", 0, true},
	} {
		got, err := ParsePolicy(tt.in)
		if (err != nil) != tt.err || (err == nil && got != tt.want) {
			t.Errorf("ParsePolicy(%q) = %v, %v", tt.in, got, err)
		}
		if err == nil {
			if back, _ := ParsePolicy(got.String()); back != got {
				t.Errorf("%v does not round-trip", got)
			}
		}
	}
}

func TestRoundRobin(t *testing.T) {
	s, _ := newTest(t, Config{Policy: PolicyRoundRobin}, ep("a"), ep("b"), ep("c"))
	var got []string
	for range 6 {
		got = append(got, do(t, s, Request{Model: "m"}, ok200).EndpointID)
	}
	if strings.Join(got, "") != "abcabc" {
		t.Fatalf("round robin order %v", got)
	}
	s.Upsert(Endpoint{ID: "b", Models: []string{"m"}, Disabled: true})
	for range 9 {
		if id := do(t, s, Request{Model: "m"}, ok200).EndpointID; id == "b" {
			t.Fatal("round robin picked a disabled endpoint")
		}
	}
}

func TestComparisonPoliciesIgnoreAffinity(t *testing.T) {
	s, _ := newTest(t, Config{Policy: PolicyRoundRobin}, ep("a"), ep("b"))
	r := Request{Model: "m", SessionKey: "s"}
	for i, want := range []struct {
		id  string
		aff Affinity
	}{{"a", AffinityMiss}, {"b", AffinityMiss}, {"a", AffinityMiss}} {
		c := do(t, s, r, ok200)
		if c.EndpointID != want.id || c.Affinity != want.aff {
			t.Fatalf("turn %d: %+v, want %v/%v", i, c, want.id, want.aff)
		}
	}
	// Same endpoint twice in a row reports a hit.
	s2, _ := newTest(t, Config{Policy: PolicyRoundRobin}, ep("a"))
	do(t, s2, r, ok200)
	if c := do(t, s2, r, ok200); c.Affinity != AffinityHit {
		t.Fatalf("%+v, want a hit", c)
	}
}

func TestLeastLoaded(t *testing.T) {
	s, _ := newTest(t, Config{Policy: PolicyLeastLoaded}, ep("a"), ep("b"), ep("c"))
	load := map[string]int{}
	for range 30 {
		c := mustPick(t, s.Begin(Request{Model: "m"}))
		load[c.EndpointID]++
		for _, id := range []string{"a", "b", "c"} {
			for _, o := range []string{"a", "b", "c"} {
				if load[id]-load[o] > 1 {
					t.Fatalf("least loaded let in-flight drift apart: %v", load)
				}
			}
		}
	}
}

func TestRandomPolicy(t *testing.T) {
	s, _ := newTest(t, Config{Policy: PolicyRandom}, ep("a"), ep("b"), ep("c"))
	count := map[string]int{}
	for range 300 {
		count[do(t, s, Request{Model: "m", SessionKey: "s"}, ok200).EndpointID]++
	}
	for _, id := range []string{"a", "b", "c"} {
		if count[id] < 60 {
			t.Fatalf("random choices %v", count)
		}
	}
}

func TestConsistentHash(t *testing.T) {
	s, _ := newTest(t, Config{Policy: PolicyConsistentHash}, ep("a"), ep("b"), ep("c"), ep("d"))
	home := map[string]string{}
	count := map[string]int{}
	for i := range 400 {
		k := fmt.Sprint("session-", i)
		c := do(t, s, Request{Model: "m", SessionKey: k}, ok200)
		home[k] = c.EndpointID
		count[c.EndpointID]++
		if c2 := do(t, s, Request{Model: "m", SessionKey: k}, ok200); c2.EndpointID != c.EndpointID || c2.Affinity != AffinityHit {
			t.Fatalf("%s: second turn %+v, first on %s", k, c2, c.EndpointID)
		}
	}
	for _, id := range []string{"a", "b", "c", "d"} {
		if count[id] < 50 {
			t.Fatalf("ring spreads sessions unevenly: %v", count)
		}
	}
	s.Remove("c")
	for k, was := range home {
		c := do(t, s, Request{Model: "m", SessionKey: k}, ok200)
		if was != "c" && c.EndpointID != was {
			t.Fatalf("%s moved from %s to %s when c left", k, was, c.EndpointID)
		}
		if c.EndpointID == "c" {
			t.Fatal("picked a removed endpoint")
		}
	}
	// An unavailable endpoint is skipped, and its keys come back after.
	var onA string
	for k, was := range home {
		if was == "a" {
			onA = k
			break
		}
	}
	s.SetHealth("a", Health{Draining: true})
	if c := do(t, s, Request{Model: "m", SessionKey: onA}, ok200); c.EndpointID == "a" {
		t.Fatal("picked a draining endpoint")
	}
	s.SetHealth("a", Health{})
	if c := do(t, s, Request{Model: "m", SessionKey: onA}, ok200); c.EndpointID != "a" {
		t.Fatalf("key did not return to a: %+v", c)
	}
}

func TestComparisonPoliciesShareAffinityCapacity(t *testing.T) {
	s, _ := newTest(t, Config{Policy: PolicyConsistentHash},
		Endpoint{ID: "a", Models: []string{"m"}, Capacity: 1}, Endpoint{ID: "b", Models: []string{"m"}, Capacity: 1})
	r := Request{Model: "m", SessionKey: "k"}
	home := do(t, s, r, ok200).EndpointID
	for i, want := range []Affinity{AffinityHit, AffinityHit, AffinityMiss} {
		c := mustPick(t, s.Begin(r))
		if c.Affinity != want || (want == AffinityHit) != (c.EndpointID == home) {
			t.Fatalf("request %d: %+v, want %v (home %s)", i, c, want, home)
		}
	}
}

func TestComparisonPoliciesKeepBreaker(t *testing.T) {
	for _, p := range []Policy{PolicyRoundRobin, PolicyRandom, PolicyLeastLoaded, PolicyConsistentHash} {
		t.Run(p.String(), func(t *testing.T) {
			s, _ := newTest(t, Config{Policy: p}, ep("a"), ep("b"))
			a := s.Begin(Request{Model: "m", SessionKey: "k"})
			c := mustPick(t, a)
			a.Report(c, Outcome{Status: 429})
			for range 20 {
				if got := do(t, s, Request{Model: "m", SessionKey: "k"}, ok200); got.EndpointID == c.EndpointID {
					t.Fatalf("picked %s with its breaker open", c.EndpointID)
				}
			}
		})
	}
}

func TestConfigDefaults(t *testing.T) {
	got := Config{}.populate()
	want := Config{
		SessionTTL: 5 * time.Minute, MaxSessions: 1_000_000, EWMAAlpha: 0.3, ColdStartSamples: 20,
		HalfOpenProbes: 3, FailureThreshold: 5, FailureRate: 0.5, FailureRateMinSamples: 10,
		Cooldown: 30 * time.Second, RateLimitCooldown: time.Minute, MaxRetryAfter: 10 * time.Minute,
		SuccessHalfLife: time.Minute, LatencyScale: time.Second, SaturatedKVUsage: 0.98,
		AffinityCapacity: 2, VirtualNodes: 100, Policy: PolicySticky, Clock: realClock{},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("defaults\n got %+v\nwant %+v", got, want)
	}
	if err := got.validate(); err != nil {
		t.Fatal(err)
	}
}

// TestConfigKeepsSetFields sets every field to a non-zero value by
// reflection and checks that defaulting keeps them all.
func TestConfigKeepsSetFields(t *testing.T) {
	var cfg Config
	v := reflect.ValueOf(&cfg).Elem()
	for i := range v.NumField() {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.Int64:
			f.SetInt(3) // durations, Seed
		case reflect.Int:
			f.SetInt(4) // counts, Policy
		case reflect.Float64:
			f.SetFloat(0.7)
		case reflect.Interface:
			f.Set(reflect.ValueOf(newFakeClock()))
		default:
			t.Fatalf("field %s of kind %v not covered", v.Type().Field(i).Name, f.Kind())
		}
	}
	if got := cfg.populate(); !reflect.DeepEqual(got, cfg) {
		t.Fatalf("populate changed set fields:\n got %+v\nwant %+v", got, cfg)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tt := range []struct {
		name string
		cfg  Config
	}{
		{"negative TTL", Config{SessionTTL: -1}},
		{"alpha above 1", Config{EWMAAlpha: 1.5}},
		{"negative alpha", Config{EWMAAlpha: -0.1}},
		{"rate min samples below 2", Config{FailureRateMinSamples: 1}},
		{"failure rate above 1", Config{FailureRate: 2}},
		{"negative probes", Config{HalfOpenProbes: -1}},
		{"unknown policy", Config{Policy: 9}},
		{"negative sessions", Config{MaxSessions: -5}},
		{"affinity capacity below 1", Config{AffinityCapacity: 0.5}},
	} {
		if _, err := New(tt.cfg); err == nil {
			t.Errorf("%s: New accepted %+v", tt.name, tt.cfg)
		}
	}
}
