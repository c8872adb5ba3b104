package relay

import (
	"testing"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// TestAuditNamesAClientsFlow: an audit carries the flow header every
// request from the relay carries, naming one of the model's recent
// clients with that client's weight and class, as its own request would.
func TestAuditNamesAClientsFlow(t *testing.T) {
	cf, err := ParseClientsFile([]byte("clients:\n  - name: night\n    keys: [sk-night]\n    weight: 3\n    class: batch\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, nil, func(c *Config) { c.Clients = cf })
	a := tb.relay.audits
	if a == nil {
		t.Fatal("no auditor")
	}
	a.addShape(time.Now(), "m1", "night", shape{messages: 1, promptBytes: 100, keys: []string{"model", "messages"}})
	_, hdr := a.prompt("m1")
	fl := transport.ParseFlow(hdr.Get(transport.HeaderFlow))
	if fl.Client != "night" || fl.Weight != 3 || fl.Class != scheduler.BandBatch || fl.Cost <= 0 {
		t.Fatalf("audit flow %+v (header %q), want client night, weight 3, batch, a cost", fl, hdr.Get(transport.HeaderFlow))
	}
}
