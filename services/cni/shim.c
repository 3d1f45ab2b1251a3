/*
 * palisade-cni: the plugin executable a container runtime starts once per pod event.
 *
 * Every CNI behaviour (the environment's and the configuration's checks, results, error objects)
 * is Python's, in services/cni/plugin.py. A Python interpreter takes 30-40 ms to start before it
 * has done anything, so this program starts instead: for ADD, DEL, CHECK, STATUS and GC it sends
 * the call as it came (the CNI_* environment and the configuration on stdin, untouched) to the
 * datapath's plugin socket, which runs that same Python code in-process, and writes back what it
 * answers: the bytes for stdout and the exit status. The protocol (services/datapath/pluginapi.py):
 *
 *   request:  "PALISADE-CNI 1 <env bytes> <stdin bytes>\n" <KEY=VALUE\0 ...> <stdin>
 *   answer:   "exit <status> <stdout bytes>\n" <stdout>    or    "handoff\n"
 *
 * Whatever it cannot do that way it hands to the Python plugin, exec'd with the same arguments,
 * environment and stdin, so it behaves exactly as the plugin alone: VERSION and anything that is
 * not a command it forwards; a configuration it cannot read (the plugin names what is wrong with
 * it); no datapath answering on the socket (ADD waits for it and answers 11, DEL queues the
 * deletion); a "handoff" answer; a DEL whose answer is lost. The Python plugin is the file
 * "<this executable's real path>-python" (services/cni/install.py puts both in place, as does
 * scripts/setup.sh for a development checkout).
 *
 * Built static (no dynamic loader at start, no glibc version asked of the node):
 *   gcc -O2 -static -o palisade-cni services/cni/shim.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

/* services/cni/spec.py: DEFAULT_SOCKET and PLUGIN_SOCKET. */
#define DEFAULT_SOCKET "/var/run/palisade/datapath/cni.sock"
#define PLUGIN_SOCKET "plugin.sock"
#define DEFAULT_VERSION "1.1.0"
/* The longest a call may take: the configuration's timeout is at most 300 s (spec.py). */
#define ANSWER_TIMEOUT_S 330
#define TRY_AGAIN_LATER 11
#define IO_FAILURE 5

static char **args;
static char *input;
static size_t input_len;
static char version[64] = DEFAULT_VERSION;

/* The inside of a JSON string: quotes and backslashes escaped, control characters left out. */
static void put_json_text(const char *text) {
	for (const char *p = text; *p; p++) {
		if (*p == '"' || *p == '\\')
			putchar('\\');
		if ((unsigned char)*p >= 0x20)
			putchar(*p);
	}
}

/* An error object (the specification's), printed as the plugin prints it; exit status 1. */
static int fail(int code, const char *msg, const char *details) {
	printf("{\"cniVersion\": \"%s\", \"code\": %d, \"msg\": \"", version, code);
	put_json_text(msg);
	printf("\", \"details\": \"");
	put_json_text(details);
	printf("\"}\n");
	fflush(stdout);
	return 1;
}

/* The Python plugin, with the same arguments and environment, and stdin as it came (once read,
 * it is given again from memory). Returns only if it cannot be run. */
static int fallback(void) {
	char exe[PATH_MAX], plugin[PATH_MAX + 16];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	if (n <= 0)
		return fail(IO_FAILURE, "palisade-cni cannot find its own executable", strerror(errno));
	exe[n] = '\0';
	snprintf(plugin, sizeof plugin, "%s-python", exe);
	if (input != NULL) {
		int fd = memfd_create("palisade-cni-stdin", 0);
		size_t done = 0;
		while (fd >= 0 && done < input_len) {
			ssize_t w = write(fd, input + done, input_len - done);
			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0) {
				close(fd);
				fd = -1;
				break;
			}
			done += (size_t)w;
		}
		if (fd < 0 || lseek(fd, 0, SEEK_SET) != 0 || dup2(fd, 0) < 0)
			return fail(IO_FAILURE, "palisade-cni cannot pass its input on to its Python plugin", strerror(errno));
		close(fd);
	}
	args[0] = plugin;
	execv(plugin, args);
	return fail(IO_FAILURE, "palisade-cni cannot run its Python plugin", plugin);
}

static int read_all(int fd, char **buf, size_t *len) {
	size_t cap = 4096;
	*len = 0;
	*buf = malloc(cap);
	for (;;) {
		if (*buf == NULL)
			return -1;
		if (*len == cap) {
			cap *= 2;
			*buf = realloc(*buf, cap);
			continue;
		}
		ssize_t r = read(fd, *buf + *len, cap - *len);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -1;
		if (r == 0)
			return 0;
		*len += (size_t)r;
	}
}

/* --- the configuration: only the top-level "socket" and "cniVersion" strings are read. A JSON
 * text this scanner does not follow (or any escape in a key or in those values) is left to the
 * Python plugin, which says what is wrong with it. */

static const char *ws(const char *p, const char *end) {
	while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
		p++;
	return p;
}

/* A string at p (which is '"'): its end (after the closing quote); *escaped says if it had any. */
static const char *string_end(const char *p, const char *end, int *escaped) {
	*escaped = 0;
	for (p++; p < end; p++) {
		if (*p == '\\') {
			*escaped = 1;
			p++;
		} else if (*p == '"') {
			return p + 1;
		}
	}
	return NULL;
}

/* Any value at p: its end, or NULL. */
static const char *value_end(const char *p, const char *end) {
	int depth = 0, escaped;
	do {
		p = ws(p, end);
		if (p >= end)
			return NULL;
		if (*p == '"') {
			if ((p = string_end(p, end, &escaped)) == NULL)
				return NULL;
		} else if (*p == '{' || *p == '[') {
			depth++;
			p++;
		} else if (*p == '}' || *p == ']') {
			if (--depth < 0)
				return NULL;
			p++;
		} else {
			const char *start = p;
			while (p < end && !strchr(",:}] \t\r\n\"{[", *p))
				p++;
			if (p == start && !(depth > 0 && (*p == ',' || *p == ':')))
				return NULL;
			if (p == start)
				p++;
		}
	} while (depth > 0);
	return p;
}

/* Copies a string value (no escapes) into out; 0, or -1 if it is not one that fits. */
static int take_string(const char *p, const char *end, char *out, size_t cap) {
	int escaped;
	const char *e;
	if (p >= end || *p != '"' || (e = string_end(p, end, &escaped)) == NULL || escaped)
		return -1;
	size_t n = (size_t)(e - p - 2);
	if (n == 0 || n >= cap || memchr(p + 1, '\0', n))
		return -1;
	memcpy(out, p + 1, n);
	out[n] = '\0';
	return 0;
}

static int read_config(char *socket_path, size_t cap) {
	const char *p = ws(input, input + input_len), *end = input + input_len;
	int escaped;
	strcpy(socket_path, DEFAULT_SOCKET);
	if (p >= end || *p++ != '{')
		return -1;
	p = ws(p, end);
	if (p < end && *p == '}')
		return ws(p + 1, end) == end ? 0 : -1;
	for (;;) {
		const char *key = ws(p, end), *key_end;
		if (key >= end || *key != '"' || (key_end = string_end(key, end, &escaped)) == NULL || escaped)
			return -1;
		p = ws(key_end, end);
		if (p >= end || *p++ != ':')
			return -1;
		p = ws(p, end);
		size_t key_len = (size_t)(key_end - key - 2);
		if (key_len == 6 && memcmp(key + 1, "socket", 6) == 0) {
			if (take_string(p, end, socket_path, cap) < 0)
				return -1;
		} else if (key_len == 10 && memcmp(key + 1, "cniVersion", 10) == 0) {
			if (take_string(p, end, version, sizeof version) < 0)
				return -1;
		}
		if ((p = value_end(p, end)) == NULL)
			return -1;
		p = ws(p, end);
		if (p < end && *p == ',') {
			p++;
			continue;
		}
		if (p < end && *p == '}')
			return ws(p + 1, end) == end ? 0 : -1;
		return -1;
	}
}

/* --- the call ----------------------------------------------------------------------------- */

/* The request, whole; -1 if the peer went away (MSG_NOSIGNAL: an error, not a SIGPIPE). */
static int send_all(int fd, struct iovec *iov, int count) {
	while (count > 0) {
		struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)count};
		ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return -1;
		while (count > 0 && (size_t)w >= iov->iov_len) {
			w -= (ssize_t)iov->iov_len;
			iov++;
			count--;
		}
		if (count > 0) {
			iov->iov_base = (char *)iov->iov_base + w;
			iov->iov_len -= (size_t)w;
		}
	}
	return 0;
}

int main(int argc, char **argv, char **envp) {
	(void)argc;
	args = argv;
	const char *command = getenv("CNI_COMMAND");
	if (command == NULL || (strcmp(command, "ADD") && strcmp(command, "DEL") && strcmp(command, "CHECK") &&
				strcmp(command, "STATUS") && strcmp(command, "GC")))
		return fallback(); /* VERSION, or not a command: stdin is still unread */
	if (read_all(0, &input, &input_len) < 0)
		return fail(IO_FAILURE, "palisade-cni cannot read its input", strerror(errno));

	char socket_path[PATH_MAX];
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (read_config(socket_path, sizeof socket_path) < 0 || socket_path[0] != '/')
		return fallback();
	char *slash = strrchr(socket_path, '/');
	int dir_len = (int)(slash - socket_path);
	if (snprintf(addr.sun_path, sizeof addr.sun_path, "%.*s/%s", dir_len, socket_path, PLUGIN_SOCKET) >=
	    (int)sizeof addr.sun_path)
		return fallback();
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0)
		return fallback(); /* no datapath answering: the plugin waits for it, or queues a DEL */

	/* The CNI_* environment, as KEY=VALUE entries each ended by a NUL. */
	size_t env_len = 0;
	for (char **e = envp; *e; e++)
		if (strncmp(*e, "CNI_", 4) == 0)
			env_len += strlen(*e) + 1;
	char *env = malloc(env_len + 1), *q = env;
	if (env == NULL)
		return fallback();
	for (char **e = envp; *e; e++)
		if (strncmp(*e, "CNI_", 4) == 0) {
			size_t n = strlen(*e) + 1;
			memcpy(q, *e, n);
			q += n;
		}
	char header[96];
	int header_len = snprintf(header, sizeof header, "PALISADE-CNI 1 %zu %zu\n", env_len, input_len);
	struct iovec iov[3] = {{header, (size_t)header_len}, {env, env_len}, {input, input_len}};
	if (send_all(fd, iov, 3) < 0) {
		close(fd);
		return fallback(); /* the request did not get there whole: the datapath did nothing */
	}

	struct timeval timeout = {.tv_sec = ANSWER_TIMEOUT_S};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
	char *answer;
	size_t answer_len;
	int status;
	size_t out_len;
	int consumed = 0;
	int ok = read_all(fd, &answer, &answer_len) == 0;
	close(fd);
	if (ok) {
		char *nl = memchr(answer, '\n', answer_len);
		if (nl != NULL && nl - answer == 7 && memcmp(answer, "handoff", 7) == 0)
			return fallback();
		if (nl != NULL) {
			*nl = '\0';
			ok = sscanf(answer, "exit %d %zu%n", &status, &out_len, &consumed) == 2 &&
			     consumed == nl - answer && out_len == answer_len - (size_t)(nl + 1 - answer);
		} else {
			ok = 0;
		}
	}
	if (!ok) {
		/* The datapath went away during the call. A DEL is repeated by the plugin (which queues it if
		 * the datapath stays away); anything else may have been done: the runtime retries it, as it
		 * does when the plugin alone meets a datapath that stops answering. */
		if (strcmp(command, "DEL") == 0)
			return fallback();
		return fail(TRY_AGAIN_LATER, "the Palisade datapath stopped answering during the call",
			    "it may be restarting; the runtime retries");
	}
	const char *out = strchr(answer, '\0') + 1;
	for (size_t done = 0; done < out_len;) {
		ssize_t w = write(1, out + done, out_len - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return 1;
		done += (size_t)w;
	}
	return status;
}
