package transport

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
)

const (
	agentUsageVersion byte = 1
	agentUsageLabel        = "computeflux agent usage proof"
	maxAgentUsage          = 256 << 10 // largest frame: a report by model
	msgAgentUsage          = FrameProtocol
)

var agentUsageFraming = Framing{Version: agentUsageVersion, MaxFrame: maxAgentUsage}

func agentUsageHandshake(token []byte) *Handshake {
	return &Handshake{Framing: agentUsageFraming, Secret: token, Label: agentUsageLabel}
}

// AgentUsageRequest is what the asker sends.
type AgentUsageRequest struct {
	// Agent is the agent's peer ID.
	Agent string `json:"agent"`
	// Sig is the agent key's signature of agentUsageSigned.
	Sig []byte `json:"sig"`
	// Since is where the report starts: a duration back ("7d", "36h") or
	// an RFC 3339 time.
	Since string `json:"since"`
}

// agentUsageSigned is what the agent's key signs.
func agentUsageSigned(relay, asker peer.ID) []byte {
	return []byte(agentUsageLabel + "\x00" + relay.String() + "\x00" + asker.String())
}

// QueryAgentUsage asks relay, from h, what the agent whose key is agentKey
// served since since, and returns the relay's JSON report. A relay that
// refuses (wrong secret, an agent it does not know, no ledger) returns a
// *RejectedError with its reason.
func QueryAgentUsage(ctx context.Context, h host.Host, relay peer.ID, token []byte, agentKey crypto.PrivKey, since string) ([]byte, error) {
	agentID, err := peer.IDFromPrivateKey(agentKey)
	if err != nil {
		return nil, err
	}
	sig, err := agentKey.Sign(agentUsageSigned(relay, h.ID()))
	if err != nil {
		return nil, err
	}
	payload, err := json.Marshal(AgentUsageRequest{Agent: agentID.String(), Sig: sig, Since: since})
	if err != nil {
		return nil, err
	}
	s, err := h.NewStream(network.WithAllowLimitedConn(ctx, "computeflux agent usage"), relay, AgentUsageProtocol)
	if err != nil {
		return nil, fmt.Errorf("open stream to %s: %w", relay, err)
	}
	defer s.Close()
	stop := context.AfterFunc(ctx, func() { _ = s.Reset() })
	defer stop()
	deadline := time.Now().Add(2 * handshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = s.SetDeadline(deadline)
	hs := agentUsageHandshake(token)
	br := bufio.NewReader(s)
	if err := hs.Initiate(br, s, h.ID(), relay, payload); err != nil {
		return nil, err
	}
	typ, body, err := hs.ReadFrame(br)
	if err != nil {
		return nil, fmt.Errorf("read the report: %w", err)
	}
	if typ == FrameReject {
		return nil, rejected(body)
	}
	if typ != msgAgentUsage {
		return nil, fmt.Errorf("unexpected frame type %d", typ)
	}
	return body, nil
}

// AgentUsageAnswer returns the report of the agent with peer ID agent
// since since, as JSON; an error is sent to the asker as the reason.
type AgentUsageAnswer func(agent peer.ID, since string) ([]byte, error)

// maxAgentUsageAnswers bounds the answers computed at once: each reads
// the ledger.
const maxAgentUsageAnswers = 2

// ServeAgentUsage answers AgentUsageProtocol streams on js's host with
// answer, for askers that prove js's secret and the agent's key. Failed
// proofs count in js's back-off, as failed joins do, so that guessing the
// secret is no faster here. Remove the handler with
// RemoveStreamHandler(AgentUsageProtocol).
func ServeAgentUsage(js *JoinServer, answer AgentUsageAnswer) error {
	if js == nil || answer == nil {
		return errors.New("agent usage: no join server or no answer")
	}
	h, lim := js.h, js.lim
	hs := agentUsageHandshake(js.token)
	busy := make(chan struct{}, maxAgentUsageAnswers)
	h.SetStreamHandler(AgentUsageProtocol, func(s network.Stream) {
		defer s.Close()
		_ = s.SetDeadline(time.Now().Add(2 * handshakeTimeout))
		asker := s.Conn().RemotePeer()
		ip := RemoteIP(s.Conn().RemoteMultiaddr())
		if ok, wait := lim.allow(asker, ip, time.Now()); !ok {
			_ = hs.Reject(s, backoffReason(wait))
			return
		}
		br := bufio.NewReader(s)
		hello, err := hs.Accept(br, s, h.ID(), asker)
		if err != nil {
			lim.failed(asker, ip, time.Now())
			if errors.Is(err, ErrBadProof) {
				_ = hs.Reject(s, "invalid proof (wrong join secret?)")
			} else {
				_ = s.Reset()
			}
			return
		}
		agent, since, err := verifyAgentUsage(hello.Payload, h.ID(), asker)
		if err != nil {
			lim.failed(asker, ip, time.Now())
			_ = hs.Reject(s, err.Error())
			return
		}
		lim.succeeded(asker, ip)
		if err := hs.Welcome(s, hello, h.ID(), asker); err != nil {
			return
		}
		select {
		case busy <- struct{}{}:
			defer func() { <-busy }()
		default:
			_ = hs.Reject(s, "the relay is answering other usage questions; retry in a moment")
			return
		}
		body, err := answer(agent, since)
		if err != nil {
			_ = hs.Reject(s, err.Error())
			return
		}
		_ = hs.WriteFrame(s, msgAgentUsage, body)
	})
	return nil
}

// verifyAgentUsage checks a request's signature against the agent's peer
// ID (its public key) for this relay and asker.
func verifyAgentUsage(payload []byte, relay, asker peer.ID) (peer.ID, string, error) {
	var req AgentUsageRequest
	if err := json.Unmarshal(payload, &req); err != nil {
		return "", "", errors.New("malformed request")
	}
	agent, err := peer.Decode(req.Agent)
	if err != nil {
		return "", "", errors.New("malformed agent peer ID")
	}
	pub, err := agent.ExtractPublicKey()
	if err != nil {
		return "", "", errors.New("the agent's peer ID holds no public key")
	}
	if ok, err := pub.Verify(agentUsageSigned(relay, asker), req.Sig); err != nil || !ok {
		return "", "", errors.New("the signature is not the agent's")
	}
	return agent, req.Since, nil
}
