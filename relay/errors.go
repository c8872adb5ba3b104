package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Error is a failure the relay reports to a client: an HTTP status and
// OpenAI's error object. Handlers return it (or any error, which becomes a
// 500) and writeError turns it into the response.
type Error struct {
	Status     int           // HTTP status
	Type       string        // OpenAI error type, e.g. "invalid_request_error"
	Code       string        // OpenAI error code, e.g. "model_not_found"
	Message    string        // human-readable text
	Param      string        // the request field at fault; empty for none (null)
	RetryAfter time.Duration // sent as Retry-After when positive
	Allow      string        // sent as Allow when set (405)
	Err        error         // cause, for logs and errors.Is; never shown to clients
}

// Error returns the message, with the cause when there is one.
func (e *Error) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%d %s: %v", e.Status, e.Message, e.Err)
	}
	return fmt.Sprintf("%d %s", e.Status, e.Message)
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// errorBody is OpenAI's error envelope.
type errorBody struct {
	Error errorObject `json:"error"`
}

type errorObject struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

func errBadRequest(code, msg string, err error) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: code, Message: msg, Err: err}
}

func errUnauthorized() *Error {
	return &Error{Status: http.StatusUnauthorized, Type: "invalid_request_error", Code: "invalid_api_key",
		Message: "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')."}
}

func errNotFound(path string) *Error {
	return &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "unknown_url",
		Message: "Unknown request URL: " + path}
}

func errMethod(method, allowed string) *Error {
	return &Error{Status: http.StatusMethodNotAllowed, Type: "invalid_request_error", Code: "method_not_allowed",
		Message: "Method " + method + " not allowed; use " + allowed, Allow: allowed}
}

func errTooLarge(limit int64) *Error {
	return &Error{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error", Code: "request_too_large",
		Message: "Request body is larger than " + strconv.FormatInt(limit, 10) + " bytes"}
}

func errModelNotFound(model string, err error) *Error {
	return &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found",
		Message: "The model '" + model + "' is not served by any agent", Err: err}
}

func errRateLimited(retryAfter time.Duration, err error) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "rate_limit_exceeded",
		Message: "Every agent serving this model is rate limited; retry later", RetryAfter: retryAfter, Err: err}
}

func errUnavailable(err error) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "no_healthy_agent",
		Message: "No healthy agent can serve this model right now", Err: err}
}

func errBadGateway(attempts int, err error) *Error {
	return &Error{Status: http.StatusBadGateway, Type: "server_error", Code: "upstream_failed",
		Message: "Every attempt to reach an agent failed (" + strconv.Itoa(attempts) + " attempts)", Err: err}
}

// asError maps any error to an *Error: an *Error as is, anything else to a 500.
func asError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return &Error{Status: http.StatusInternalServerError, Type: "server_error", Code: "internal_error",
		Message: "Internal error", Err: err}
}

// writeError is the one place that turns an error into OpenAI's error JSON
// and an HTTP status.
func writeError(w http.ResponseWriter, err error) *Error {
	return writeErrorAs(w, err, errorJSON)
}

// writeErrorFor is writeError in the error shape of path's API: Anthropic's
// for the Messages API, OpenAI's for the rest.
func writeErrorFor(path string, w http.ResponseWriter, err error) *Error {
	if path == pathMessages {
		return writeErrorAs(w, err, anthropicErrorJSON) // messages.go
	}
	return writeErrorAs(w, err, errorJSON)
}

// writeErrorAs writes err's status and headers, and its body as shape
// says.
func writeErrorAs(w http.ResponseWriter, err error, shape func(*Error) []byte) *Error {
	e := asError(err)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	if e.RetryAfter > 0 {
		secs := int64((e.RetryAfter + time.Second - 1) / time.Second)
		h.Set("Retry-After", strconv.FormatInt(secs, 10))
	}
	if e.Allow != "" {
		h.Set("Allow", e.Allow)
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(append(shape(e), '\n'))
	return e
}

// errorJSON is e in OpenAI's error envelope; an empty Param or Code is
// null, as OpenAI sends them.
func errorJSON(e *Error) []byte {
	var v struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    *string `json:"code"`
		} `json:"error"`
	}
	v.Error.Message, v.Error.Type = e.Message, e.Type
	if e.Param != "" {
		v.Error.Param = &e.Param
	}
	if e.Code != "" {
		v.Error.Code = &e.Code
	}
	b, _ := json.Marshal(&v)
	return b
}

// streamErrorEvent is the server-sent event that ends a stream that failed
// after its first byte reached the client.
func streamErrorEvent(msg, code string) []byte {
	b, _ := json.Marshal(errorBody{Error: errorObject{Message: msg, Type: "server_error", Code: code}})
	out := make([]byte, 0, len(b)+8)
	out = append(out, "data: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}
