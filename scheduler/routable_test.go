package scheduler

import "testing"

func TestRoutable(t *testing.T) {
	cases := []struct {
		name   string
		ep     *Endpoint // nil: never registered
		health Health
		remove bool
		want   bool
	}{
		{name: "healthy", ep: &Endpoint{ID: "a", Models: []string{"m"}}, want: true},
		{name: "busy engine", ep: &Endpoint{ID: "a", Models: []string{"m"}}, health: Health{Running: 9, Waiting: 9, KVCacheUsage: 1}, want: true},
		{name: "unknown", want: false},
		{name: "no models", ep: &Endpoint{ID: "a"}, want: false},
		{name: "disabled", ep: &Endpoint{ID: "a", Models: []string{"m"}, Disabled: true}, want: false},
		{name: "draining", ep: &Endpoint{ID: "a", Models: []string{"m"}}, health: Health{Draining: true}, want: false},
		{name: "suspect", ep: &Endpoint{ID: "a", Models: []string{"m"}}, health: Health{Suspect: true}, want: false},
		{name: "removed", ep: &Endpoint{ID: "a", Models: []string{"m"}}, remove: true, want: false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newTest(t, Config{})
			if c.ep != nil {
				s.Upsert(*c.ep)
				s.SetHealth(c.ep.ID, c.health)
			}
			if c.remove {
				s.Remove("a")
			}
			if got := s.Routable("a"); got != c.want {
				t.Fatalf("Routable = %v, want %v", got, c.want)
			}
		})
	}
}
