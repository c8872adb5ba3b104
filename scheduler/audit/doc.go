// Package audit judges what contributed engines really run: it compares
// answers to the same greedy audit prompt (Compare), turns a round of
// answers from the agent under audit and its references into verdicts
// (Judge), keeps a score per agent and model with its evidence and turns it
// into a routing weight and quarantine (Book), paces audits within a share
// of the served tokens (Budget), and checks every answer for things no
// honest engine reports (CheckAnswer, LoadCheck).
//
// Everything here is pure: no I/O, no goroutines, time passed in by the
// caller. The relay sends the audits and feeds the answers in.
package audit
