/*
 * mapa-hook-client: the hook wrappers' fast path, compiled (`mapa hooks DIR --cc CC` builds it).
 *
 *     mapa-hook-client prolog|epilog
 *
 * The same request and the same exit statuses as slurm_mapa/slurm/agent/client.py's prolog and
 * epilog kinds, without a Python start (about 15 ms of CPU per hook, twice per job): it sends the
 * job's few SLURM_* variables to the node's mapa-agent over its root-only Unix socket and waits
 * for the agent to run the hook. Exit status 0: the agent answered "done". 3: no agent, a full
 * listen backlog, a refusal, an error or no answer in time: the wrapper then runs the hook
 * in-process (the slow path, same code).
 *
 * Protocol version 1: "MAPA1 <kind> <length>\n", then <length> bytes of KEY=VALUE pairs separated
 * by NUL bytes (each value cut at MAX_VALUE_BYTES); one answer line back. The client keeps its end
 * open until it has the answer, so the agent can tell that a killed client no longer wants it.
 *
 * It reads only its environment (slurmd's, for the hook) and writes only to the socket: no file,
 * no shell, bounded sizes, nothing printed.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#define FALL_BACK 3
#define MAX_VALUE_BYTES 8192
#define MAX_ANSWER_BYTES 4096
#define CONNECT_TIMEOUT_MS 2000
#define ANSWER_TIMEOUT_MS 25000
#define DEFAULT_SOCKET "/run/slurm-mapa-agent/agent.sock"

/* What the hooks read from slurmd's environment (client.py's KEYS, in its order). */
static const char *const KEYS[] = {"SLURM_JOB_ID",        "SLURMD_NODENAME", "SLURM_JOB_GPUS", "SLURM_JOB_COMMENT",
                                   "SLURM_JOB_NUM_NODES", "SLURM_JOB_SLUID"};
#define N_KEYS (sizeof(KEYS) / sizeof(KEYS[0]))
#define MAX_REQUEST_BYTES (64 + N_KEYS * (MAX_VALUE_BYTES + 64))

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for ``events`` on fd until ``deadline`` (now_ms()); 1 when ready, 0 otherwise. */
static int wait_for(int fd, short events, long long deadline)
{
	for (;;) {
		long long left = deadline - now_ms();
		if (left <= 0)
			return 0;
		struct pollfd p = {.fd = fd, .events = events};
		int n = poll(&p, 1, left > 60000 ? 60000 : (int)left);
		if (n > 0)
			return (p.revents & (events | POLLHUP | POLLERR)) ? 1 : 0;
		if (n < 0 && errno != EINTR)
			return 0;
	}
}

int main(int argc, char **argv)
{
	static char request[MAX_REQUEST_BYTES];
	static char payload[MAX_REQUEST_BYTES];
	char answer[MAX_ANSWER_BYTES + 1];
	size_t used = 0, got = 0;
	const char *kind, *path;
	struct sockaddr_un addr;
	int fd, header;

	if (argc != 2 || (strcmp(argv[1], "prolog") != 0 && strcmp(argv[1], "epilog") != 0))
		return FALL_BACK;
	kind = argv[1];
	for (size_t i = 0; i < N_KEYS; i++) {
		const char *value = getenv(KEYS[i]);
		size_t key_len = strlen(KEYS[i]), value_len;
		if (value == NULL)
			continue;
		value_len = strnlen(value, MAX_VALUE_BYTES);
		if (used > 0)
			payload[used++] = '\0';
		memcpy(payload + used, KEYS[i], key_len);
		used += key_len;
		payload[used++] = '=';
		memcpy(payload + used, value, value_len);
		used += value_len;
	}
	header = snprintf(request, 64, "MAPA1 %s %zu\n", kind, used);
	if (header <= 0 || header >= 64)
		return FALL_BACK;
	memcpy(request + header, payload, used);
	used += (size_t)header;

	path = getenv("MAPA_AGENT_SOCKET");
	if (path == NULL || *path == '\0')
		path = DEFAULT_SOCKET;
	if (strlen(path) >= sizeof(addr.sun_path))
		return FALL_BACK;
	memset(&addr, 0, sizeof(addr));
	addr.sun_family = AF_UNIX;
	strcpy(addr.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return FALL_BACK;
	/* Non-blocking: a full listen backlog fails at once with EAGAIN instead of waiting for an accept. */
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		close(fd);
		return FALL_BACK;
	}
	long long deadline = now_ms() + CONNECT_TIMEOUT_MS;
	for (size_t sent = 0; sent < used;) {
		ssize_t n = send(fd, request + sent, used - sent, MSG_NOSIGNAL);
		if (n > 0) {
			sent += (size_t)n;
		} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
			if (!wait_for(fd, POLLOUT, deadline)) {
				close(fd);
				return FALL_BACK;
			}
		} else {
			close(fd);
			return FALL_BACK;
		}
	}
	deadline = now_ms() + ANSWER_TIMEOUT_MS;
	while (got < MAX_ANSWER_BYTES && memchr(answer, '\n', got) == NULL) {
		ssize_t n = recv(fd, answer + got, MAX_ANSWER_BYTES - got, 0);
		if (n > 0) {
			got += (size_t)n;
		} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
			if (!wait_for(fd, POLLIN, deadline))
				break;
		} else {
			break;
		}
	}
	close(fd);
	char *end = memchr(answer, '\n', got);
	if (end == NULL)
		return FALL_BACK;
	*end = '\0';
	return strcmp(answer, "done") == 0 ? 0 : FALL_BACK;
}
