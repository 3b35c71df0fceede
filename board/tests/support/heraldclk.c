/* heraldclk: an ioplug playback PCM for herald's tests (no hardware needed).
 *
 * Fields: rate, channels, format (constrain the hardware parameters like a codec), realtime
 * (the pointer follows CLOCK_MONOTONIC and underruns like a driver), frozen (the pointer never
 * moves), lock "<path>" (an exclusive flock: a second opener gets -EBUSY, like hw:), and
 * fault "<path>": a file whose first word injects a fault while the PCM is in use, read at
 * every open, prepare, pointer and transfer, so that a test can break a running stream from
 * outside the process:
 *   unplug  the device is gone (a USB speaker pulled out): the stream's state becomes
 *           DISCONNECTED and open, prepare and transfer fail with -ENODEV, as a removed card's
 *           ioctls do;
 *   freeze  the pointer stops where it is (a codec whose clock stopped);
 *   busy    open fails with -EBUSY (another process holds the device).
 * A word followed by "after N" (frames) starts the fault once the application has written N
 * frames since prepare (at open: at once). No file, an empty file or another word: no fault. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>
#include <alsa/asoundlib.h>
#include <alsa/pcm_external.h>

typedef struct {
	snd_pcm_ioplug_t io;
	int realtime;
	int frozen; /* never consumes: a device whose clock stopped */
	int lock_fd;
	char *fault; /* path of the fault file, or NULL */
	int running;
	struct timespec t0;
	snd_pcm_uframes_t accepted; /* frames written by the application since prepare */
	snd_pcm_uframes_t played;   /* frames consumed since prepare */
	snd_pcm_uframes_t boundary;
} clk_t;

enum { FAULT_NONE, FAULT_UNPLUG, FAULT_FREEZE, FAULT_BUSY };

/* The fault the file names, or FAULT_NONE. A word may be followed by "after N": the fault
 * starts once the application has written N frames since prepare (*after = N, else 0), so a
 * test can break the stream at an exact point, such as after the last write. */
static int fault_now(const char *path, unsigned long *after)
{
	char buf[48];
	ssize_t n;
	int fd;
	*after = 0;
	if (!path)
		return FAULT_NONE;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return FAULT_NONE;
	n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return FAULT_NONE;
	buf[n] = 0;
	if (strstr(buf, " after "))
		*after = strtoul(strstr(buf, " after ") + 7, NULL, 10);
	if (!strncmp(buf, "unplug", 6))
		return FAULT_UNPLUG;
	if (!strncmp(buf, "freeze", 6))
		return FAULT_FREEZE;
	if (!strncmp(buf, "busy", 4))
		return FAULT_BUSY;
	return FAULT_NONE;
}

static uint64_t elapsed_frames(clk_t *c)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	double s = (double)(now.tv_sec - c->t0.tv_sec) + (double)(now.tv_nsec - c->t0.tv_nsec) / 1e9;
	return (uint64_t)(s * c->io.rate);
}

static void arm(clk_t *c, int on)
{
	struct itimerspec its;
	memset(&its, 0, sizeof its);
	if (on) {
		long ns = (long)((double)c->io.period_size * 1e9 / c->io.rate);
		if (ns < 1000000)
			ns = 1000000;
		its.it_value.tv_sec = ns / 1000000000;
		its.it_value.tv_nsec = ns % 1000000000;
		its.it_interval = its.it_value;
	}
	timerfd_settime(c->io.poll_fd, 0, &its, NULL);
}

static int clk_start(snd_pcm_ioplug_t *io)
{
	clk_t *c = io->private_data;
	clock_gettime(CLOCK_MONOTONIC, &c->t0);
	c->running = 1;
	arm(c, 1);
	return 0;
}

static int clk_stop(snd_pcm_ioplug_t *io)
{
	clk_t *c = io->private_data;
	c->running = 0;
	arm(c, 0);
	return 0;
}

static snd_pcm_sframes_t clk_pointer(snd_pcm_ioplug_t *io)
{
	clk_t *c = io->private_data;
	unsigned long after;
	int fault = fault_now(c->fault, &after);
	if (c->accepted < after)
		fault = FAULT_NONE;
	if (fault == FAULT_UNPLUG) {
		/* what a removed card's stream shows: state DISCONNECTED (alsa-lib's calls then fail
		 * with -ENODEV); returning an error here instead would read as an underrun */
		snd_pcm_ioplug_set_state(io, SND_PCM_STATE_DISCONNECTED);
		return c->played % c->boundary;
	}
	if (c->running && !c->frozen && fault != FAULT_FREEZE) {
		if (!c->realtime) {
			c->played = c->accepted;
		} else {
			uint64_t p = elapsed_frames(c);
			if (p > c->accepted) {
				if (io->state != SND_PCM_STATE_DRAINING)
					return -EPIPE; /* underrun: the clock passed the written data */
				p = c->accepted;
			}
			c->played = p;
		}
	}
	return c->played % c->boundary;
}

static snd_pcm_sframes_t clk_transfer(snd_pcm_ioplug_t *io, const snd_pcm_channel_area_t *areas,
				      snd_pcm_uframes_t offset, snd_pcm_uframes_t size)
{
	clk_t *c = io->private_data;
	(void)areas;
	(void)offset;
	unsigned long after;
	if (fault_now(c->fault, &after) == FAULT_UNPLUG && c->accepted >= after)
		return -ENODEV;
	c->accepted += size;
	return size;
}

static int clk_prepare(snd_pcm_ioplug_t *io)
{
	clk_t *c = io->private_data;
	unsigned long after;
	if (fault_now(c->fault, &after) == FAULT_UNPLUG && after == 0)
		return -ENODEV;
	c->running = 0;
	arm(c, 0);
	c->accepted = 0;
	c->played = 0;
	return 0;
}

static int clk_hw_params(snd_pcm_ioplug_t *io, snd_pcm_hw_params_t *params)
{
	clk_t *c = io->private_data;
	snd_pcm_uframes_t bs = 0;
	snd_pcm_hw_params_get_buffer_size(params, &bs);
	if (bs == 0)
		bs = 1;
	c->boundary = bs;
	while (c->boundary * 2 <= LONG_MAX - bs)
		c->boundary *= 2;
	return 0;
}

static int clk_poll_revents(snd_pcm_ioplug_t *io, struct pollfd *pfd, unsigned int nfds,
			    unsigned short *revents)
{
	uint64_t ticks;
	(void)nfds;
	if (pfd[0].revents & POLLIN) {
		ssize_t r = read(io->poll_fd, &ticks, sizeof ticks);
		(void)r;
		*revents = POLLOUT;
	} else {
		*revents = 0;
	}
	return 0;
}

static int clk_close(snd_pcm_ioplug_t *io)
{
	clk_t *c = io->private_data;
	close(io->poll_fd);
	if (c->lock_fd >= 0)
		close(c->lock_fd); /* releases the flock */
	free(c->fault);
	free(c);
	return 0;
}

static const snd_pcm_ioplug_callback_t callbacks = {
	.start = clk_start,
	.stop = clk_stop,
	.pointer = clk_pointer,
	.transfer = clk_transfer,
	.prepare = clk_prepare,
	.hw_params = clk_hw_params,
	.poll_revents = clk_poll_revents,
	.close = clk_close,
};

SND_PCM_PLUGIN_DEFINE_FUNC(heraldclk)
{
	snd_config_iterator_t i, next;
	long rate = 0, channels = 0;
	const char *format = NULL, *lock = NULL, *fault = NULL;
	int realtime = 0, frozen = 0, err;
	clk_t *c;
	(void)root;

	snd_config_for_each(i, next, conf) {
		snd_config_t *n = snd_config_iterator_entry(i);
		const char *id;
		if (snd_config_get_id(n, &id) < 0)
			continue;
		if (!strcmp(id, "comment") || !strcmp(id, "type") || !strcmp(id, "hint"))
			continue;
		if (!strcmp(id, "rate") && snd_config_get_integer(n, &rate) == 0)
			continue;
		if (!strcmp(id, "channels") && snd_config_get_integer(n, &channels) == 0)
			continue;
		if (!strcmp(id, "format") && snd_config_get_string(n, &format) == 0)
			continue;
		if (!strcmp(id, "lock") && snd_config_get_string(n, &lock) == 0)
			continue;
		if (!strcmp(id, "fault") && snd_config_get_string(n, &fault) == 0)
			continue;
		if (!strcmp(id, "realtime")) {
			realtime = snd_config_get_bool(n);
			if (realtime >= 0)
				continue;
		}
		if (!strcmp(id, "frozen")) {
			frozen = snd_config_get_bool(n);
			if (frozen >= 0)
				continue;
		}
		SNDERR("heraldclk: bad field %s", id);
		return -EINVAL;
	}
	if (stream != SND_PCM_STREAM_PLAYBACK)
		return -EINVAL;
	unsigned long after;
	switch (fault_now(fault, &after)) {
	case FAULT_UNPLUG:
		return -ENODEV;
	case FAULT_BUSY:
		return -EBUSY;
	}

	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->realtime = realtime;
	c->frozen = frozen;
	c->lock_fd = -1;
	c->boundary = 1;
	if (fault && !(c->fault = strdup(fault))) {
		free(c);
		return -ENOMEM;
	}
	if (lock) {
		c->lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
		if (c->lock_fd < 0) {
			err = -errno;
			free(c->fault);
			free(c);
			return err;
		}
		if (flock(c->lock_fd, LOCK_EX | LOCK_NB) < 0) {
			close(c->lock_fd);
			free(c->fault);
			free(c);
			return -EBUSY;
		}
	}
	c->io.version = SND_PCM_IOPLUG_VERSION;
	c->io.name = "herald test clock";
	c->io.callback = &callbacks;
	c->io.private_data = c;
	c->io.flags = SND_PCM_IOPLUG_FLAG_BOUNDARY_WA;
	c->io.poll_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
	c->io.poll_events = POLLIN;
	if (c->io.poll_fd < 0) {
		err = -errno;
		goto fail;
	}
	err = snd_pcm_ioplug_create(&c->io, name, stream, mode);
	if (err < 0)
		goto fail;
	{
		static const unsigned int access[] = { SND_PCM_ACCESS_RW_INTERLEAVED, SND_PCM_ACCESS_MMAP_INTERLEAVED };
		static const unsigned int any_format[] = { SND_PCM_FORMAT_S16_LE, SND_PCM_FORMAT_S32_LE, SND_PCM_FORMAT_FLOAT_LE };
		unsigned int one_format[1];
		snd_pcm_ioplug_set_param_list(&c->io, SND_PCM_IOPLUG_HW_ACCESS, 2, access);
		if (format) {
			one_format[0] = (unsigned int)snd_pcm_format_value(format);
			snd_pcm_ioplug_set_param_list(&c->io, SND_PCM_IOPLUG_HW_FORMAT, 1, one_format);
		} else {
			snd_pcm_ioplug_set_param_list(&c->io, SND_PCM_IOPLUG_HW_FORMAT, 3, any_format);
		}
		snd_pcm_ioplug_set_param_minmax(&c->io, SND_PCM_IOPLUG_HW_CHANNELS,
						channels ? channels : 1, channels ? channels : 8);
		snd_pcm_ioplug_set_param_minmax(&c->io, SND_PCM_IOPLUG_HW_RATE,
						rate ? rate : 8000, rate ? rate : 192000);
		snd_pcm_ioplug_set_param_minmax(&c->io, SND_PCM_IOPLUG_HW_PERIOD_BYTES, 64, 1 << 20);
		snd_pcm_ioplug_set_param_minmax(&c->io, SND_PCM_IOPLUG_HW_PERIODS, 2, 64);
	}
	*pcmp = c->io.pcm;
	return 0;
fail:
	if (c->io.poll_fd >= 0)
		close(c->io.poll_fd);
	if (c->lock_fd >= 0)
		close(c->lock_fd);
	free(c->fault);
	free(c);
	return err;
}

SND_PCM_PLUGIN_SYMBOL(heraldclk);
