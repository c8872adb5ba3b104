package relay

import (
	"errors"
	"net/http"

	"github.com/computeflux/computeflux/relay/anthropic"
)

// Anthropic's Messages API (POST /v1/messages) through any engine. A
// request is read once, at prepare, into the chat completions request it
// means (anthropic.ToChat); the relay routes, queues and accounts that like
// any chat request (its model, session, prompt prefix and size). Each
// attempt then goes one of two ways:
//   - to an agent whose engine lists /v1/messages (transport.JoinInfo.APIs):
//     the client's request as it is, and the engine's answer as it is;
//   - to any other endpoint: the chat request, to /v1/chat/completions,
//     and its answer turned back into a Messages answer as it comes
//     (anthropic.Writer).
// Translated attempts are chat requests for the audits too: they get the
// relay's seed and pseudonyms, and their answers may be tapped. Errors on
// the route are in Anthropic's shape (writeErrorFor).

// messagesReq is what prepare made of a Messages request.
type messagesReq struct {
	anthropic.Request
	agentChat []byte // the chat request as agents get it (forward.go); nil means Chat
}

// messagesToChat reads a Messages request; what the API refuses is a 400
// naming the field at fault.
func messagesToChat(body []byte) (*messagesReq, error) {
	req, err := anthropic.ToChat(body)
	var re *anthropic.RequestError
	if errors.As(err, &re) {
		return nil, &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: re.Code,
			Param: re.Param, Message: re.Message, Err: re.Err}
	}
	if err != nil {
		return nil, err
	}
	return &messagesReq{Request: *req}, nil
}

// anthropicErrorJSON is e in Anthropic's error envelope.
func anthropicErrorJSON(e *Error) []byte { return anthropic.ErrorJSON(e.Status, e.Message) }
