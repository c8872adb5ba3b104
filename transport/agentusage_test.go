package transport

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/peer"
)

func newKeyID(t *testing.T) (crypto.PrivKey, peer.ID) {
	t.Helper()
	k, _, err := crypto.GenerateEd25519Key(nil)
	if err != nil {
		t.Fatal(err)
	}
	id, err := peer.IDFromPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return k, id
}

// Only the holder of the agent's key, asking from the connection the
// signature names, to the relay it names, is believed.
func TestVerifyAgentUsage(t *testing.T) {
	agentKey, agentID := newKeyID(t)
	otherKey, _ := newKeyID(t)
	_, relayID := newKeyID(t)
	_, otherRelay := newKeyID(t)
	_, asker := newKeyID(t)
	_, thief := newKeyID(t)
	sign := func(k crypto.PrivKey, relay, asker peer.ID) []byte {
		sig, err := k.Sign(agentUsageSigned(relay, asker))
		if err != nil {
			t.Fatal(err)
		}
		return sig
	}
	req := func(agent string, sig []byte) []byte {
		b, _ := json.Marshal(AgentUsageRequest{Agent: agent, Sig: sig, Since: "7d"})
		return b
	}
	got, since, err := verifyAgentUsage(req(agentID.String(), sign(agentKey, relayID, asker)), relayID, asker)
	if err != nil || got != agentID || since != "7d" {
		t.Fatalf("the agent's own request: %v %q %v", got, since, err)
	}
	for _, c := range []struct {
		what    string
		payload []byte
		relay   peer.ID
		asker   peer.ID
		want    string
	}{
		{"signed by another key", req(agentID.String(), sign(otherKey, relayID, asker)), relayID, asker, "signature"},
		{"replayed from another connection", req(agentID.String(), sign(agentKey, relayID, asker)), relayID, thief, "signature"},
		{"replayed to another relay", req(agentID.String(), sign(agentKey, relayID, asker)), otherRelay, asker, "signature"},
		{"no signature", req(agentID.String(), nil), relayID, asker, "signature"},
		{"not a peer ID", req("gpu-1", sign(agentKey, relayID, asker)), relayID, asker, "peer ID"},
		{"not JSON", []byte("{"), relayID, asker, "malformed"},
	} {
		if _, _, err := verifyAgentUsage(c.payload, c.relay, c.asker); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error about %q", c.what, err, c.want)
		}
	}
}
