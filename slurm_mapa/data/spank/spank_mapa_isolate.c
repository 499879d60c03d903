/*
 * spank_mapa_isolate: the root-side trigger of MAPA's GPU isolation (docs/isolation.md).
 *
 * Slurm calls slurm_spank_task_init_privileged in each task process, after fork and before the
 * task drops to the job's user (src/slurmd/slurmstepd/mgr.c, _pre_task_child_privileged), so
 * before the TaskProlog and before the user's program. This hook asks the node's mapa-agent, on
 * its root-only socket, to isolate the asking process: the agent takes the pid from the socket
 * (SO_PEERCRED), checks that it is a task process of a Slurm step and reads the job from the
 * kernel's cgroup path, as for the TaskProlog's request. The request carries the step's
 * SLURM_STEP_GPUS as Slurm set it for the step (src/slurmd/slurmstepd/slurmstepd.c,
 * gres_g_step_set_env), read here before Slurm narrows it to each task's own GPUs (task.c,
 * gres_g_task_set_env, after this hook), and MAPA_STEP_ENV=1 saying so (without SLURM_STEP_GPUS:
 * a step of no GPUs). The agent isolates the step to MAPA's GPUs for those, and remembers them
 * for the TaskPrologs of the step's tasks. The user cannot skip this hook, so the step's GPUs are
 * enforced whatever the job's environment; a user's own SLURM_STEP_GPUS can at most name GPUs of
 * the same job. The TaskProlog (as the user) exports what each task uses.
 *
 * What the TaskProlog trusts: when the agent has isolated the task for this request, it writes,
 * before answering, a record of the task process in a directory only root can write
 * (<isolate socket's directory>/tasks/<pid>: job, step, the process's start time, state, GPUs;
 * slurm/isolation/task_records.py). The TaskProlog, a child of this process, believes that record
 * only, checked against its own job, step and its parent's start time; then, under isolation_scope
 * "step", it makes no request of its own. The state the agent answers (cgroup-v1, cgroup-v2, off,
 * failed-open) still goes into the task's MAPA_SPANK_ISOLATION, and the GPUs the task may open
 * into MAPA_SPANK_GPUS, but a user can set both in the environment srun and sbatch pass on, so
 * they decide nothing: the TaskProlog unsets them (a job submitted from the task must not inherit
 * them) and, when MAPA_SPANK_ISOLATION claims isolation that no record backs, makes its own
 * request and says so to the agent, which logs it.
 *
 * plugstack.conf:
 *     optional /usr/local/lib/slurm-mapa/spank_mapa_isolate.so [fail-open|fail-closed] [socket=PATH] [timeout_ms=N]
 *
 * socket=PATH: the agent's root-only socket (an absolute path; default DEFAULT_SOCKET below).
 * timeout_ms=N: one deadline for the whole exchange with the agent, retries included: N
 * milliseconds, a plain decimal number from 100 to 60000 (default 10000). No call waits past it:
 * the socket is non-blocking and connect, write and read each wait in poll() for what is left.
 * Any other argument, or a malformed one, fails every task (slurmstepd logs why).
 *
 * What happens to the task (the TaskProlog's request, agent_client.py isolate, does the same):
 *
 *   the agent ...                                             fail-open (default)   fail-closed
 *   answered "done <state> ..." (isolated, off, failed-open)  runs                  runs
 *   answered "error <why>" other than busy (its mapa.toml     fails                 fails
 *     mode refused), or a line outside the protocol
 *   cannot be asked (no socket, connection refused), gave     runs, slurm_info      fails, slurm_error
 *     no whole answer before the deadline, or stayed busy         says why              says why
 *     until it ("error busy", or its listen backlog full)
 *
 * Busy is retried with a short back-off (10 ms doubling to 250 ms) while the deadline allows: a
 * full listen backlog (a non-blocking AF_UNIX connect's EAGAIN; a blocking connect would wait
 * for an accept for ever) and "error busy" (the agent runs as many requests as it may).
 *
 * Build: mapa spank-plugin (cc -O2 -Wall -shared -fPIC -o spank_mapa_isolate.so spank_mapa_isolate.c;
 * the cluster image and the tests add -Wextra -Werror). It needs the Slurm headers: Debian's
 * libslurm-dev, RHEL's slurm-devel.
 */
#define _GNU_SOURCE /* SOCK_NONBLOCK, SOCK_CLOEXEC, MSG_NOSIGNAL, clock_gettime whatever -std= says */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(mapa_isolate, 1);

#define DEFAULT_SOCKET "/run/slurm-mapa-agent/agent.sock"
#define MAX_REQUEST 1200 /* "MAPA1 isolate N\n" + MAPA_STEP_ENV=1 + SLURM_STEP_GPUS of up to 1024 bytes */
#define BUSY_ANSWER "error busy"
#define ANSWER_TIMEOUT_MS 10000     /* isolation takes milliseconds; the task waits this long at most */
#define MIN_TIMEOUT_MS 100
#define MAX_TIMEOUT_MS 60000
#define FIRST_BACKOFF_MS 10
#define MAX_BACKOFF_MS 250

struct settings {
	int fail_closed;
	const char *socket_path;
	long timeout_ms;
};

/* What one request came to: an answer line, a busy agent (worth asking again), or nothing. */
enum asked { ANSWERED, BUSY, UNREACHABLE };

/* N of timeout_ms=N: digits only, no leading zero, MIN_TIMEOUT_MS..MAX_TIMEOUT_MS. 0 or -1. */
static int parse_timeout(const char *text, long *timeout_ms)
{
	size_t digits = strspn(text, "0123456789");
	long value = 0;

	if (digits == 0 || digits > 5 || text[digits] != '\0' || text[0] == '0')
		return -1;
	for (size_t i = 0; i < digits; i++)
		value = value * 10 + (text[i] - '0');
	if (value < MIN_TIMEOUT_MS || value > MAX_TIMEOUT_MS)
		return -1;
	*timeout_ms = value;
	return 0;
}

static int parse_args(int ac, char **av, struct settings *settings)
{
	settings->fail_closed = 0;
	settings->socket_path = DEFAULT_SOCKET;
	settings->timeout_ms = ANSWER_TIMEOUT_MS;
	for (int i = 0; i < ac; i++) {
		if (strcmp(av[i], "fail-open") == 0)
			settings->fail_closed = 0;
		else if (strcmp(av[i], "fail-closed") == 0)
			settings->fail_closed = 1;
		else if (strncmp(av[i], "socket=", 7) == 0 && av[i][7] == '/' &&
			 strlen(av[i] + 7) < sizeof(((struct sockaddr_un *)0)->sun_path))
			settings->socket_path = av[i] + 7;
		else if (strncmp(av[i], "timeout_ms=", 11) == 0 && parse_timeout(av[i] + 11, &settings->timeout_ms) == 0)
			continue;
		else {
			slurm_error("mapa_isolate: unknown argument '%s' (accepted: fail-open, fail-closed, "
				    "socket=/absolute/path, timeout_ms=%d..%d)", av[i], MIN_TIMEOUT_MS, MAX_TIMEOUT_MS);
			return -1;
		}
	}
	return 0;
}

/* Milliseconds on the monotonic clock (long long: a 32-bit long overflows after 24 days up). */
static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait until fd has one of events (or an error or hang-up to report): 1; the deadline passed: 0;
 * poll failed: -1 (errno). */
static int wait_for(int fd, short events, long long deadline)
{
	for (;;) {
		struct pollfd pollfd = { .fd = fd, .events = events };
		long long left = deadline - now_ms();
		int ready;

		if (left <= 0)
			return 0;
		ready = poll(&pollfd, 1, left > INT_MAX ? INT_MAX : (int)left);
		if (ready > 0)
			return 1;
		if (ready < 0 && errno != EINTR)
			return -1;
	}
}

/* Sleep ms milliseconds if the deadline leaves that much time: 1, else 0 at once. */
static int pause_before(long ms, long long deadline)
{
	struct timespec left = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L };

	if (now_ms() + ms >= deadline)
		return 0;
	while (nanosleep(&left, &left) < 0 && errno == EINTR)
		;
	return 1;
}

static enum asked give_up(int fd, enum asked asked)
{
	close(fd);
	return asked;
}

/* The request (agent_client.py's protocol): the kind, then NUL-separated KEY=VALUE pairs, the
 * step's SLURM_STEP_GPUS when Slurm set it and it is a plain list of indices. Its length. */
static size_t build_request(spank_t sp, char *request, size_t size)
{
	char gpus[1025] = "";
	char payload[1100];
	int length;

	if (spank_getenv(sp, "SLURM_STEP_GPUS", gpus, sizeof(gpus)) != ESPANK_SUCCESS ||
	    strspn(gpus, "0123456789,-") != strlen(gpus))
		gpus[0] = '\0';
	if (gpus[0])
		length = snprintf(payload, sizeof(payload), "MAPA_STEP_ENV=1%cSLURM_STEP_GPUS=%s", '\0', gpus);
	else
		length = snprintf(payload, sizeof(payload), "MAPA_STEP_ENV=1");
	if (length < 0 || (size_t)length >= sizeof(payload))
		length = 0;
	int head = snprintf(request, size, "MAPA1 isolate %d\n", length);
	if (head < 0 || (size_t)(head + length) >= size)
		return 0;
	memcpy(request + head, payload, (size_t)length);
	return (size_t)(head + length);
}

/* One request, all of it before deadline; the answer line (without its newline) in answer, or
 * why there is none. */
static enum asked ask(const struct settings *settings, const char *request, size_t length, long long deadline,
		      char *answer, size_t size)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	const char *path = settings->socket_path;
	size_t sent = 0, used = 0;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	int ready;
	char *newline;

	if (fd < 0) {
		snprintf(answer, size, "socket: %s", strerror(errno));
		return UNREACHABLE;
	}
	strncpy(address.sun_path, path, sizeof(address.sun_path) - 1);
	if (connect(fd, (struct sockaddr *)&address, sizeof(address)) < 0) {
		int error = errno;
		socklen_t error_size = sizeof(error);

		if (error == EINPROGRESS || error == EINTR) { /* it goes on: poll says when it is done */
			ready = wait_for(fd, POLLOUT, deadline);
			if (ready <= 0)
				error = ready == 0 ? ETIMEDOUT : errno;
			else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &error_size) < 0)
				error = errno;
		}
		if (error == EAGAIN) {
			/* The listen backlog is full: the agent accepts nothing now. */
			snprintf(answer, size, "%s: its listen backlog is full", path);
			return give_up(fd, BUSY);
		}
		if (error != 0) {
			snprintf(answer, size, "%s: %s", path, strerror(error));
			return give_up(fd, UNREACHABLE);
		}
	}
	while (sent < length) {
		ssize_t put;

		ready = wait_for(fd, POLLOUT, deadline);
		if (ready <= 0)
			goto waited;
		put = send(fd, request + sent, length - sent, MSG_NOSIGNAL); /* no SIGPIPE in the task */
		if (put < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (put < 0) {
			snprintf(answer, size, "%s: %s", path, strerror(errno));
			return give_up(fd, UNREACHABLE);
		}
		sent += (size_t)put;
	}
	while (used + 1 < size) {
		ssize_t got;

		ready = wait_for(fd, POLLIN, deadline);
		if (ready <= 0)
			goto waited;
		got = read(fd, answer + used, size - 1 - used);
		if (got < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (got < 0) {
			snprintf(answer, size, "%s: %s", path, strerror(errno));
			return give_up(fd, UNREACHABLE);
		}
		if (got == 0)
			break;
		used += (size_t)got;
		if (memchr(answer + used - (size_t)got, '\n', (size_t)got))
			break;
	}
	close(fd);
	answer[used] = '\0';
	newline = strchr(answer, '\n');
	if (!newline) {
		snprintf(answer, size, "an unfinished answer from %s", path);
		return UNREACHABLE;
	}
	*newline = '\0';
	return strcmp(answer, BUSY_ANSWER) == 0 ? BUSY : ANSWERED;

waited:
	if (ready == 0)
		snprintf(answer, size, "no answer from %s within %ld ms", path, settings->timeout_ms);
	else
		snprintf(answer, size, "poll: %s", strerror(errno));
	return give_up(fd, UNREACHABLE);
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	struct settings settings;
	char answer[1024];
	char request[MAX_REQUEST];
	size_t length;
	enum asked asked;
	long long deadline;
	long backoff = FIRST_BACKOFF_MS;

	if (!spank_remote(sp))
		return 0;
	if (parse_args(ac, av, &settings) < 0)
		return -1;
	length = build_request(sp, request, sizeof(request));
	if (length == 0) {
		slurm_error("mapa_isolate: could not build the request");
		return settings.fail_closed ? -1 : 0;
	}
	deadline = now_ms() + settings.timeout_ms;
	/* Busy: ask again while the deadline allows. */
	while ((asked = ask(&settings, request, length, deadline, answer, sizeof(answer))) == BUSY &&
	       pause_before(backoff, deadline))
		backoff = backoff * 2 > MAX_BACKOFF_MS ? MAX_BACKOFF_MS : backoff * 2;
	if (asked == ANSWERED && strncmp(answer, "done ", 5) == 0) {
		/* isolated, off, or failed open: the agent logged which; the task's environment says it,
		 * and (isolated) which GPUs the task may open: "done <state> gpus=<list|none> ..." */
		char *state = answer + 5;
		char *rest = state + strcspn(state, " ");
		char *gpus = NULL;

		if (*rest == ' ') {
			*rest++ = '\0';
			if (strncmp(rest, "gpus=", 5) == 0) {
				gpus = rest + 5;
				gpus[strcspn(gpus, " ")] = '\0';
				if (strcmp(gpus, "none") == 0)
					gpus[0] = '\0';
				else if (strspn(gpus, "0123456789,") != strlen(gpus))
					gpus = NULL;
			}
		}
		if (spank_setenv(sp, "MAPA_SPANK_ISOLATION", state, 1) != ESPANK_SUCCESS)
			slurm_error("mapa_isolate: could not set MAPA_SPANK_ISOLATION=%s", state);
		if (gpus != NULL && strncmp(state, "cgroup-", 7) == 0 &&
		    spank_setenv(sp, "MAPA_SPANK_GPUS", gpus, 1) != ESPANK_SUCCESS)
			slurm_error("mapa_isolate: could not set MAPA_SPANK_GPUS=%s", gpus);
		return 0;
	}
	if (asked == ANSWERED) {
		/* The agent refused (its mapa.toml says fail-closed), or an unknown answer. */
		slurm_error("mapa_isolate: GPU isolation failed, the task does not start: %s", answer);
		return -1;
	}
	/* Not asked, no answer in time, or busy until the deadline: this plugin's mode decides. */
	if (settings.fail_closed) {
		slurm_error("mapa_isolate: %s mapa-agent (%s); the task does not start (fail-closed)",
			    asked == BUSY ? "busy until the deadline:" : "cannot ask", answer);
		return -1;
	}
	slurm_info("mapa_isolate: %s mapa-agent (%s); the task runs without GPU isolation (fail-open)",
		   asked == BUSY ? "busy until the deadline:" : "cannot ask", answer);
	return 0;
}
