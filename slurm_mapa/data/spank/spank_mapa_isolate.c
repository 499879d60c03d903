/*
 * spank_mapa_isolate: the root-side trigger of MAPA's GPU isolation (docs/isolation.md).
 *
 * Slurm calls slurm_spank_task_init_privileged in each task process, after fork and before the
 * task drops to the job's user (src/slurmd/slurmstepd/mgr.c, _pre_task_child_privileged), so
 * before the TaskProlog and before the user's program. This hook asks the node's mapa-agent, on
 * its root-only socket, to isolate the asking process: the agent takes the pid from the socket
 * (SO_PEERCRED), checks that it is a task process of a Slurm step and reads the job from the
 * kernel's cgroup path, as for the TaskProlog's request. Nothing the user controls is sent, and
 * the user cannot skip this hook, so the job's GPUs are enforced whatever the job's environment.
 * The TaskProlog still asks too (as the user): that narrows a smaller step to its GPUs and
 * exports the ranks CUDA needs; the agent applies each cgroup once. The state the agent answers
 * (cgroup-v1, cgroup-v2, off, failed-open) goes into the task's MAPA_SPANK_ISOLATION, which the
 * TaskProlog reads (when its own request gets no answer) and unsets, so that a job submitted from
 * the task does not inherit it.
 *
 * plugstack.conf:
 *     required /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_mapa_isolate.so [fail-open|fail-closed] [socket=PATH]
 *
 * fail-open (default): a task the agent cannot be asked about runs, and slurmstepd logs why.
 * fail-closed: it fails. When the agent answers, its own mapa.toml mode decides ("error ..."
 * fails the task).
 *
 * Build: gcc -O2 -Wall -shared -fPIC -o spank_mapa_isolate.so spank_mapa_isolate.c
 * (needs the Slurm headers: Debian's libslurm-dev).
 */
#include <errno.h>
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
#define REQUEST "MAPA1 isolate 0\n" /* the agent's protocol (agent_client.py); no payload */
#define ANSWER_TIMEOUT_MS 10000     /* isolation takes milliseconds; the task waits this long at most */
#define BUSY_RETRIES 5

struct settings {
	int fail_closed;
	const char *socket_path;
};

static int parse_args(int ac, char **av, struct settings *settings)
{
	settings->fail_closed = 0;
	settings->socket_path = DEFAULT_SOCKET;
	for (int i = 0; i < ac; i++) {
		if (strcmp(av[i], "fail-open") == 0)
			settings->fail_closed = 0;
		else if (strcmp(av[i], "fail-closed") == 0)
			settings->fail_closed = 1;
		else if (strncmp(av[i], "socket=", 7) == 0 && av[i][7] == '/' &&
			 strlen(av[i] + 7) < sizeof(((struct sockaddr_un *)0)->sun_path))
			settings->socket_path = av[i] + 7;
		else {
			slurm_error("mapa_isolate: unknown argument '%s' (accepted: fail-open, fail-closed, "
				    "socket=/absolute/path)", av[i]);
			return -1;
		}
	}
	return 0;
}

static long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* One request; the answer line (without its newline) in answer. 0, or -1 with why in answer. */
static int ask(const char *socket_path, char *answer, size_t size)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	size_t used = 0;
	long deadline = now_ms() + ANSWER_TIMEOUT_MS;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0) {
		snprintf(answer, size, "socket: %s", strerror(errno));
		return -1;
	}
	strncpy(address.sun_path, socket_path, sizeof(address.sun_path) - 1);
	if (connect(fd, (struct sockaddr *)&address, sizeof(address)) < 0 ||
	    write(fd, REQUEST, strlen(REQUEST)) != (ssize_t)strlen(REQUEST)) {
		snprintf(answer, size, "%s: %s", socket_path, strerror(errno));
		close(fd);
		return -1;
	}
	while (used + 1 < size) {
		struct pollfd readable = { .fd = fd, .events = POLLIN };
		long left = deadline - now_ms();
		int ready = left > 0 ? poll(&readable, 1, (int)left) : 0;
		ssize_t got;

		if (ready < 0 && errno == EINTR)
			continue;
		if (ready <= 0) {
			snprintf(answer, size, "no answer from %s within %d ms", socket_path, ANSWER_TIMEOUT_MS);
			close(fd);
			return -1;
		}
		got = read(fd, answer + used, size - 1 - used);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			break;
		used += (size_t)got;
		if (memchr(answer, '\n', used))
			break;
	}
	close(fd);
	answer[used] = '\0';
	char *newline = strchr(answer, '\n');
	if (!newline) {
		snprintf(answer, size, "an unfinished answer from %s", socket_path);
		return -1;
	}
	*newline = '\0';
	return 0;
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	struct settings settings;
	char answer[1024];
	int rc = -1;

	if (!spank_remote(sp))
		return 0;
	if (parse_args(ac, av, &settings) < 0)
		return -1;
	for (int attempt = 0; attempt < BUSY_RETRIES; attempt++) {
		rc = ask(settings.socket_path, answer, sizeof(answer));
		if (rc < 0 || strcmp(answer, "error busy") != 0)
			break;
		usleep(20000 * (attempt + 1));
	}
	if (rc == 0 && strncmp(answer, "done ", 5) == 0) {
		/* isolated, off, or failed open: the agent logged which; the task's environment says it */
		char *state = answer + 5;
		state[strcspn(state, " ")] = '\0';
		if (spank_setenv(sp, "MAPA_SPANK_ISOLATION", state, 1) != ESPANK_SUCCESS)
			slurm_error("mapa_isolate: could not set MAPA_SPANK_ISOLATION=%s", state);
		return 0;
	}
	if (rc == 0) {
		/* The agent refused (its mapa.toml says fail-closed), or an unknown answer. */
		slurm_error("mapa_isolate: GPU isolation failed, the task does not start: %s", answer);
		return -1;
	}
	if (settings.fail_closed) {
		slurm_error("mapa_isolate: cannot ask mapa-agent (%s); the task does not start (fail-closed)", answer);
		return -1;
	}
	slurm_info("mapa_isolate: cannot ask mapa-agent (%s); the task runs without GPU isolation (fail-open)", answer);
	return 0;
}
