package rlplugin

import "sync"

// inFlight counts, per endpoint, the requests this picker sent there and has
// not yet seen answered: from PreRequest (the endpoint is chosen) to the end
// of the response stream. The scraped vLLM gauge lags by a scrape interval
// and still counts a batch that has just finished, so the next turn of a
// conversation read a busy home replica and spilled; this count drops the
// moment the answer passes the picker, as the embedded router's does.
//
// llm-d calls the response hook with EndOfStream exactly once for every
// request that passed PreRequest, also when the upstream call fails or the
// client goes away (the handler's deferred clean-up), so nothing leaks.
// Requests that reach a replica without passing the picker are not counted.
type inFlight struct {
	mu    sync.Mutex
	count map[string]int    // endpoint key -> requests in flight
	byReq map[string]string // request id -> endpoint key
}

func newInFlight() *inFlight {
	return &inFlight{count: map[string]int{}, byReq: map[string]string{}}
}

// start records request id on endpoint ep (a re-scheduled id moves).
func (f *inFlight) start(id, ep string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if old, ok := f.byReq[id]; ok {
		f.dec(old)
	}
	f.byReq[id] = ep
	f.count[ep]++
}

// finish forgets request id; unknown ids (never started) are ignored.
func (f *inFlight) finish(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ep, ok := f.byReq[id]; ok {
		delete(f.byReq, id)
		f.dec(ep)
	}
}

func (f *inFlight) dec(ep string) {
	if f.count[ep]--; f.count[ep] <= 0 {
		delete(f.count, ep)
	}
}

// get is the number of requests in flight on endpoint ep.
func (f *inFlight) get(ep string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.count[ep]
}
