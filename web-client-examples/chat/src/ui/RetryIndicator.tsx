import { useCountdown, type RunView } from "../tether";

export function RetryIndicator({ retry }: { retry: NonNullable<RunView["retry"]> }) {
  const seconds = useCountdown(retry.nextAttemptAt);
  return (
    <div className="retry" data-testid="retry-indicator" data-attempt={retry.attempt} data-max-attempts={retry.maxAttempts}>
      Attempt {retry.attempt} of {retry.maxAttempts} failed
      {retry.error.httpStatus ? ` (HTTP ${retry.error.httpStatus}, ${retry.error.code})` : ` (${retry.error.code})`}:{" "}
      {retry.error.message} Attempt {Math.min(retry.attempt + 1, retry.maxAttempts)}{" "}
      <span data-testid="retry-countdown">{seconds !== null && seconds > 0 ? `in ${seconds} s` : "now"}</span>.
    </div>
  );
}
