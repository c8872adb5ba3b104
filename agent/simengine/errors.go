package simengine

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
)

// APIError is an error with the HTTP status and OpenAI error fields it is
// answered with. Handlers return errors; writeError is the one place that
// turns them into a response.
type APIError struct {
	Status  int    // HTTP status
	Type    string // OpenAI error type, e.g. "invalid_request_error"
	Code    string // OpenAI error code, e.g. "model_not_found"; may be empty
	Param   string // offending parameter; may be empty
	Message string
}

// Error returns the message.
func (e *APIError) Error() string { return e.Message }

func badRequest(param, format string, args ...any) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: param, Message: fmt.Sprintf(format, args...)}
}

// errorBody is OpenAI's error JSON.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// toAPIError maps an error to its response.
func toAPIError(err error) *APIError {
	var ae *APIError
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &mbe):
		return &APIError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error", Message: fmt.Sprintf("request body larger than %d bytes", mbe.Limit)}
	case errors.Is(err, ErrQueueFull):
		return &APIError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "server_overloaded", Message: "the engine's request queue is full; retry later"}
	case errors.Is(err, ErrContextLength):
		return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded", Param: "messages", Message: err.Error()}
	case errors.Is(err, ErrBadRequest):
		return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: err.Error()}
	case errors.Is(err, errClosing):
		return &APIError{Status: http.StatusServiceUnavailable, Type: "server_error", Message: "the engine is shutting down"}
	}
	return &APIError{Status: http.StatusInternalServerError, Type: "server_error", Message: err.Error()}
}

// writeError answers with the OpenAI error JSON for err.
func writeError(w http.ResponseWriter, err error) {
	ae := toAPIError(err)
	var b errorBody
	b.Error.Message, b.Error.Type = ae.Message, ae.Type
	if ae.Param != "" {
		b.Error.Param = &ae.Param
	}
	if ae.Code != "" {
		b.Error.Code = &ae.Code
	}
	if ae.Status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, ae.Status, &b)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // the client may be gone; nothing to do about it
}
