// Command fakeenvoy is the end-to-end test's stand-in for Envoy in front of
// moerl-epp (tests/integration/test_llmd_epp.py): an HTTP proxy on loopback
// that, for every request, does what Envoy's ext_proc filter does with the
// endpoint picker. It sends the request headers and body down one
// ExternalProcessor.Process stream, forwards the request to the endpoint named
// in the x-gateway-destination-endpoint header the EPP sets (or returns the
// EPP's immediate response, e.g. 429 when every endpoint is filtered out),
// then sends the upstream response headers and body down the same stream.
//
// It is not a gateway: no retries, TLS, routing tables or load balancing of
// its own. Each response carries x-moerl-endpoint (the picked ip:port) so the
// test can see where a request went.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const (
	destinationHeader = "x-gateway-destination-endpoint"
	endpointHeader    = "x-moerl-endpoint"
)

type proxy struct {
	epp      extproc.ExternalProcessorClient
	upstream *http.Client
}

func headerMap(kv map[string]string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for k, v := range kv {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)})
	}
	return m
}

// decide sends the request phase and returns the destination, or the EPP's
// immediate response.
func decide(stream extproc.ExternalProcessor_ProcessClient, headers map[string]string, body []byte) (string, *extproc.ImmediateResponse, error) {
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: headerMap(headers)}}}); err != nil {
		return "", nil, err
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		return "", nil, err
	}
	dest := ""
	for {
		resp, err := stream.Recv()
		if err != nil {
			return "", nil, err
		}
		switch r := resp.Response.(type) {
		case *extproc.ProcessingResponse_ImmediateResponse:
			return "", r.ImmediateResponse, nil
		case *extproc.ProcessingResponse_RequestHeaders:
			for _, h := range r.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if strings.EqualFold(h.GetHeader().GetKey(), destinationHeader) {
					dest = string(h.GetHeader().GetRawValue())
				}
			}
		case *extproc.ProcessingResponse_RequestBody:
			return dest, nil, nil
		}
	}
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	headers := map[string]string{":method": r.Method, ":path": r.URL.RequestURI(), ":authority": r.Host,
		":scheme": "http", "content-length": strconv.Itoa(len(body))}
	for k, vs := range r.Header {
		headers[strings.ToLower(k)] = strings.Join(vs, ",")
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Minute)
	defer cancel()
	stream, err := p.epp.Process(ctx)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusBadGateway)
		return
	}
	dest, immediate, err := decide(stream, headers, body)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusBadGateway)
		return
	}
	if immediate != nil {
		w.Header().Set("x-fakeenvoy-immediate", "1")
		w.WriteHeader(int(immediate.GetStatus().GetCode()))
		_, _ = w.Write(append(immediate.GetBody(), []byte(immediate.GetDetails())...))
		return
	}
	if dest == "" {
		http.Error(w, "ext_proc: the EPP set no "+destinationHeader, http.StatusBadGateway)
		return
	}
	up, err := http.NewRequestWithContext(ctx, r.Method, "http://"+dest+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	up.Header = r.Header.Clone()
	resp, err := p.upstream.Do(up)
	if err != nil {
		http.Error(w, "upstream "+dest+": "+err.Error(), http.StatusBadGateway)
		return
	}
	respBody, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		http.Error(w, "upstream "+dest+": "+err.Error(), http.StatusBadGateway)
		return
	}
	// the response phase, as Envoy reports it; the EPP's answers change nothing here
	_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extproc.HttpHeaders{Headers: headerMap(map[string]string{
			":status": strconv.Itoa(resp.StatusCode), "content-type": resp.Header.Get("content-type")})}}})
	_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
		ResponseBody: &extproc.HttpBody{Body: respBody, EndOfStream: true}}})
	_ = stream.CloseSend()
	for {
		if _, err := stream.Recv(); err != nil {
			break
		}
	}
	for k, vs := range resp.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	w.Header().Set(endpointHeader, dest)
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(respBody)
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "HTTP address to serve (loopback)")
	epp := flag.String("epp", "127.0.0.1:9002", "the EPP's ext_proc gRPC address")
	flag.Parse()
	conn, err := grpc.NewClient(*epp, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("fakeenvoy: %v", err)
	}
	p := &proxy{epp: extproc.NewExternalProcessorClient(conn), upstream: &http.Client{Timeout: 10 * time.Minute}}
	fmt.Printf("fakeenvoy: serving %s, EPP at %s\n", *listen, *epp)
	log.Fatal(http.ListenAndServe(*listen, p))
}
